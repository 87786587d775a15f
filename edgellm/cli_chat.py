"""`edgellm chat`: a terminal chat with a model (registered on the click group in edgellm/cli.py)."""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import click

from edgellm.cli_options import prompt_cache_options
from edgellm.cli_pull import model_option
from edgellm.cli_speculative import speculative_options

KV_DTYPE_HELP = "KV cache type for K and V: f32, f16, bf16 or q8_0 (llama.cpp's -ctk/-ctv q8_0: 0.53x f16's memory)."


@click.command()
@model_option
@click.option("--system", default=None, metavar="TEXT", help="System prompt.")
@click.option("--temperature", "--temp", type=click.FloatRange(min=0), default=0.8, show_default=True,
              help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.95, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True)
@click.option("--min-p", type=click.FloatRange(0, 1), default=0.05, show_default=True)
@click.option("--repeat-penalty", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True)
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=256, show_default=True,
              help="Longest answer, in tokens.")
@click.option("--seed", "-s", type=int, default=None)
@click.option("--ctx-size", "-c", "ctx_size", type=click.IntRange(min=2), default=None,
              help="Context size in tokens (default 4096, capped at the model's); older turns drop out beyond it.")
@click.option("--threads", "-t", type=click.IntRange(min=1), default=None,
              help="Worker threads (default: physical cores).")
@click.option("--kv-dtype", default="f32", show_default=True, metavar="TYPE", help=KV_DTYPE_HELP)
@click.option("--load", "load_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Resume a conversation saved with /save.")
@prompt_cache_options(default_on=True)
@speculative_options
def chat(model, system, temperature, top_p, top_k, min_p, repeat_penalty, max_tokens, seed, ctx_size, threads,
         kv_dtype, load_file, prompt_cache, prompt_cache_gb, speculative):
    """Chat with a model in the terminal (streamed answers, prompt cache across turns).

    A long system prompt is computed once: its KV blocks are kept on disk (--prompt-cache) for the next start.
    Type /help inside for commands. When stdin is not a terminal, each input line is one message and only the
    answers are printed, one after another, each followed by a newline."""
    from edgellm.cli_errors import friendly_errors

    friendly_errors(_run)(model=model, system=system, max_tokens=max_tokens, temperature=temperature,
                          top_p=top_p, top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed,
                          ctx_size=ctx_size, threads=threads, kv_dtype=kv_dtype, load_file=load_file,
                          prompt_cache=prompt_cache, prompt_cache_gb=prompt_cache_gb, speculative=speculative)


def _run(*, model, system, ctx_size, threads, kv_dtype, load_file, prompt_cache, prompt_cache_gb, speculative,
         **sampling) -> None:
    from edgellm.api import LLM
    from edgellm.chat import ChatSession
    from edgellm.chat_ui import ChatUI
    from edgellm.model_kind import COMPLETION_STOPS, completion_template, model_kind
    from edgellm.model_path import cache_dir, resolve_model
    from edgellm.sampling import SamplingParams

    interactive = sys.stdin.isatty()
    show = sys.stderr.isatty()
    params = SamplingParams(**sampling)
    path = resolve_model(model, progress=show)
    if show:
        click.echo(f"loading {os.path.basename(path)} ...", err=True)
    t0 = time.perf_counter()
    llm = LLM(path, threads=threads, ctx_size=ctx_size, kv_dtype=kv_dtype, progress=show, prompt_cache=prompt_cache,
              prompt_cache_gb=prompt_cache_gb, speculative=speculative)
    if model_kind(llm.loaded.metadata).is_base:  # completion-style: a transcript the base model continues
        llm.chat_template = completion_template(llm.tokenizer)
        params = dataclasses.replace(params, stop=[*params.stop, *COMPLETION_STOPS])
    session = ChatSession(llm, system=system, params=params)
    if load_file:
        session.load(load_file)
    history = str(cache_dir() / "chat_history") if interactive else None
    ui = ChatUI(session, interactive=interactive, history_file=history)
    if show:
        name = llm.config.name or os.path.basename(path)
        click.echo(f"{name} ready in {time.perf_counter() - t0:.1f}s · ctx {llm.ctx_size} · "
                   f"{llm.threads} threads" + (" · /help for commands, Ctrl-D to quit" if interactive else ""),
                   err=True)
    code = ui.run()
    llm.shutdown()  # the prompt cache's last blocks are written
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    chat()
