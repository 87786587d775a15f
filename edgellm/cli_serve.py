"""`edgellm serve`: the OpenAI-compatible HTTP server (registered on the click group in edgellm/cli.py)."""
from __future__ import annotations

import sys

import click

from edgellm.cli_chat import KV_DTYPE_HELP
from edgellm.cli_options import prompt_cache_options
from edgellm.cli_pull import model_option
from edgellm.cli_speculative import speculative_options
from edgellm.errors import EdgeLLMError


@click.command()
@model_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", "-p", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", envvar="EDGELLM_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1 and tokenizer routes (env EDGELLM_API_KEY).")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests decoded together in one engine step.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests waiting beyond the batch before new ones get 429.")
@click.option("--ctx-size", "-c", "ctx_size", type=click.IntRange(min=2), default=None,
              help="Context size in tokens (default 4096, capped at the model's).")
@click.option("--kv-cache-tokens", type=click.IntRange(min=16), default=None,
              help="KV cache size in tokens, shared by all requests (default: the context size).")
@click.option("--threads", "-t", type=click.IntRange(min=1), default=None,
              help="Worker threads (default: physical cores).")
@click.option("--kv-dtype", default="f32", show_default=True, metavar="TYPE", help=KV_DTYPE_HELP)
@click.option("--served-model-name", default=None, help="Model id in the API (default: the file name).")
@click.option("--no-webui", is_flag=True, help="Leave out the browser chat at / and the dashboard at /dashboard.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
@prompt_cache_options
@speculative_options
def serve(model, host, port, api_key, max_batch, max_queue, ctx_size, kv_cache_tokens, threads, kv_dtype,
          served_model_name, no_webui, log_level, prompt_cache, prompt_cache_gb, speculative):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...), with a
    chat page at / and an engine dashboard at /dashboard.

    The port opens at once; /health answers 503 until the model is loaded."""
    try:
        import uvicorn

        from edgellm.model_path import resolve_model
        from edgellm.server.app import create_app
    except ImportError as e:
        click.echo(f"edgellm: error: the server needs its extra: pip install 'edgellm[server]' ({e})", err=True)
        sys.exit(2)
    try:
        from edgellm.engine.kv_cache import check_kv_dtype

        from edgellm.engine.speculative import parse_speculative

        check_kv_dtype(kv_dtype)  # a bad name fails here, not in the loading thread
        parse_speculative(speculative)
        path = resolve_model(model, progress=sys.stderr.isatty())  # a wrong path fails here, not in the thread
    except EdgeLLMError as e:
        click.echo(f"edgellm: error: {e}", err=True)
        sys.exit(2)
    kwargs = dict(threads=threads, ctx_size=ctx_size, kv_cache_tokens=kv_cache_tokens, max_batch=max_batch,
                  kv_dtype=kv_dtype, progress=False, prompt_cache=prompt_cache, prompt_cache_gb=prompt_cache_gb,
                  speculative=speculative)
    app = create_app(model=path, llm_kwargs=kwargs, api_key=api_key, max_queue=max_queue,
                     model_id=served_model_name, webui=not no_webui)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"edgellm: warning: listening on {host} without --api-key", err=True)
    if not no_webui:
        click.echo(f"edgellm: chat at http://{host}:{port}/ , dashboard at http://{host}:{port}/dashboard", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    serve()
