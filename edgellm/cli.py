"""edgellm command line: each subcommand is a short function over the Python API.

Any EdgeLLMError (bad file, bad argument, context overflow...) prints one line and exits with code 2.
"""
from __future__ import annotations

import json
import sys
from collections import Counter

import click

from edgellm.cli_chat import KV_DTYPE_HELP
from edgellm.cli_errors import friendly_errors
from edgellm.cli_options import prompt_cache_options
from edgellm.cli_pull import model_option
from edgellm.cli_speculative import speculative_options
threads_option = click.option("--threads", "-t", type=click.IntRange(min=1), default=None,
                              help="Worker threads (default: physical cores).")
ctx_option = click.option("--ctx-size", "-c", "ctx_size", type=click.IntRange(min=2), default=None,
                          help="Context size in tokens (default 4096, capped at the model's).")
kv_dtype_option = click.option("--kv-dtype", default="f32", show_default=True, metavar="TYPE", help=KV_DTYPE_HELP)



def _llm(model, threads=None, ctx_size=None, **kw):
    from edgellm.api import LLM

    return LLM(model, threads=threads, ctx_size=ctx_size, **kw)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgellm")
def main():
    """edgellm: run GGUF language models on CPUs, in Python, with nothing to compile."""


@main.command()
@model_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@friendly_errors
def info(model, as_json):
    """Describe a model: architecture, parameters, quant types, context, vocabulary, base or instruct."""
    from edgellm.api import load_model
    from edgellm.model_kind import model_kind

    lm = load_model(model)
    cfg, g = lm.config, lm.gguf
    n_params = sum(t.n_elements for t in g.tensors.values())
    d = {
        "path": g.path, "name": cfg.name, "architecture": cfg.arch, "gguf_version": g.version,
        "parameters": n_params, "tensors": len(g.tensors),
        "tensor_types": dict(sorted(Counter(t.qtype.name for t in g.tensors.values()).items())),
        "context_length": cfg.n_ctx_train, "embedding_length": cfg.d_model, "layers": cfg.n_layers,
        "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "sliding_window": cfg.sliding_window or None, "vocab_size": cfg.n_vocab,
        "tokenizer": g.metadata.get("tokenizer.ggml.model"),
        "chat_template": "tokenizer.chat_template" in g.metadata,
        "kind": model_kind(g.metadata).kind, "kind_reason": model_kind(g.metadata).why, "files": len(g.paths),
    }
    if as_json:
        click.echo(json.dumps(d))
        return
    for k, v in d.items():
        if k == "parameters":
            v = f"{v:,} ({v / 1e6:.0f}M)"
        elif k == "tensor_types":
            v = ", ".join(f"{n} {t}" for t, n in v.items())
        elif k == "kind_reason":
            continue
        elif k == "kind":
            v = f"{v} ({d['kind_reason']})"
        click.echo(f"{k:18s} {v}")


@main.command()
@model_option
@click.option("--no-special", is_flag=True, help="Treat control-token text (e.g. <start_of_turn>) as plain text.")
@click.argument("text")
@friendly_errors
def tokenize(model, no_special, text):
    """Print the token ids of TEXT as a JSON list (no BOS)."""
    from edgellm.api import load_model
    from edgellm.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(load_model(model).metadata)
    click.echo(json.dumps(tok.encode(text, add_bos=False, special=not no_special)))


def sampling_options(fn):
    opts = [
        click.option("--max-tokens", "-n", type=click.IntRange(min=0), default=256, show_default=True),
        click.option("--temperature", "--temp", type=click.FloatRange(min=0), default=0.8, show_default=True,
                     help="0 = greedy."),
        click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.95, show_default=True),
        click.option("--min-p", type=click.FloatRange(0, 1), default=0.05, show_default=True),
        click.option("--repeat-penalty", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True),
        click.option("--seed", "-s", type=int, default=None),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def make_params(max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, seed, stop):
    from edgellm.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, stop=list(stop))


@main.command()
@model_option
@click.option("--prompt", "-p", required=True, help="Prompt text (BOS added as the model's metadata says).")
@sampling_options
@threads_option
@ctx_option
@kv_dtype_option
@click.option("--json-schema", "json_schema", type=click.File("r"), default=None,
              help="Constrain the output to JSON valid under this JSON schema file.")
@prompt_cache_options
@speculative_options
@friendly_errors
def generate(model, prompt, threads, ctx_size, kv_dtype, json_schema, prompt_cache, prompt_cache_gb, speculative,
             **sp):
    """Complete a prompt; prints only the completion, streamed as it is produced."""
    params = make_params(**sp)
    if json_schema is not None:
        import dataclasses

        params = dataclasses.replace(params, json_schema=json_schema.read())  # invalid: a named error, exit 2
    llm = _llm(model, threads, ctx_size, kv_dtype=kv_dtype, prompt_cache=prompt_cache, prompt_cache_gb=prompt_cache_gb,
               speculative=speculative)
    out = sys.stdout
    for piece in llm.stream(prompt, params):
        out.write(piece)
        out.flush()
    out.write("\n")
    llm.shutdown()  # the prompt cache's last blocks are written


@main.command()
@model_option
@click.option("--file", "-f", "file", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--ctx", type=click.IntRange(min=4), default=512, show_default=True, help="Window size in tokens.")
@click.option("--json", "as_json", is_flag=True, help="Last line: {ppl, n_tokens, nll}.")
@threads_option
@kv_dtype_option
@friendly_errors
def perplexity(model, file, ctx, as_json, threads, kv_dtype):
    """Perplexity of a text file, computed as llama-perplexity does."""
    from edgellm.perplexity import perplexity as run

    with open(file, encoding="utf-8", errors="replace") as f:
        text = f.read()
    llm = _llm(model, threads, ctx_size=ctx, kv_dtype=kv_dtype)
    res = run(llm, text, n_ctx=ctx, progress=sys.stderr.isatty())
    click.echo(f"perplexity: {res.ppl:.4f} over {res.n_tokens} tokens (ctx {ctx})", err=as_json)
    if as_json:
        click.echo(json.dumps({"ppl": res.ppl, "n_tokens": res.n_tokens, "nll": res.nll}))


@main.command()
@model_option
@click.option("-p", "n_prompt", type=click.IntRange(min=0), default=512, show_default=True, help="Prompt tokens (pp).")
@click.option("-n", "n_gen", type=click.IntRange(min=0), default=128, show_default=True, help="Generated tokens (tg).")
@click.option("--repetitions", "-r", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@threads_option
@friendly_errors
def bench(model, n_prompt, n_gen, repetitions, as_json, threads):
    """Throughput like llama-bench: prompt processing and token generation tokens/s, peak RSS."""
    from edgellm.bench import bench as run

    llm = _llm(model, threads, ctx_size=max(n_prompt, n_gen) + 16, load_tokenizer=False)  # token ids only
    r = run(llm, n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions)
    if as_json:
        click.echo(json.dumps(r.as_dict()))
        return
    click.echo(f"model    {llm.loaded.path}\nthreads  {r.threads}")
    if r.pp_tps is not None and n_prompt:
        click.echo(f"pp{n_prompt:<6d} {r.pp_tps:10.2f} tokens/s")
    if r.tg_tps is not None and n_gen:
        click.echo(f"tg{n_gen:<6d} {r.tg_tps:10.2f} tokens/s")
    click.echo(f"peak RSS {r.rss_mb:.0f} MiB")


from edgellm.cli_chat import chat  # noqa: E402
from edgellm.cli_pull import list_models, pull, rm  # noqa: E402
from edgellm.cli_quantize import convert, quantize  # noqa: E402
from edgellm.cli_serve import serve  # noqa: E402

main.add_command(chat)
main.add_command(pull)
main.add_command(list_models)
main.add_command(rm)
main.add_command(serve)
main.add_command(quantize)
main.add_command(convert)

if __name__ == "__main__":
    main()
