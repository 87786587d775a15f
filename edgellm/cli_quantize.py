"""`edgellm quantize` (GGUF -> GGUF, llama.cpp's mixes) and `edgellm convert` (HF checkpoint -> GGUF)."""
from __future__ import annotations

import json
import sys

import click

from edgellm.architectures import HF_ARCHS
from edgellm.cli_errors import friendly_errors
from quant.mixes import FTYPES


@click.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dst", type=click.Path(dir_okay=False))
@click.option("--type", "ftype", required=True, type=click.Choice(list(FTYPES), case_sensitive=False),
              help="llama.cpp file type (mix), e.g. Q4_K_M, Q8_0, F16.")
@click.option("--allow-requantize", is_flag=True, help="Allow re-quantizing tensors that are already quantized.")
@click.option("--leave-output-tensor", is_flag=True, help="Keep output.weight in its current type.")
@click.option("--threads", "-t", type=click.IntRange(min=1), default=None, help="Worker threads (default: cores).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@friendly_errors
def quantize(src, dst, ftype, allow_requantize, leave_output_tensor, threads, as_json):
    """Quantize the GGUF model SRC to DST (no imatrix; bytes as llama-quantize writes them)."""
    from kernels_cpu import physical_cores
    from convert.quantize_model import describe, quantize_model

    res = quantize_model(src, dst, ftype, allow_requantize=allow_requantize,
                         leave_output_tensor=leave_output_tensor, threads=threads or physical_cores(),
                         progress=sys.stderr.isatty())
    d = describe(res)
    if as_json:
        click.echo(json.dumps(d))
    else:
        types = ", ".join(f"{n} {t}" for t, n in sorted(d["types"].items()))
        click.echo(f"{d['path']}: {d['mib_in']:.1f} MiB -> {d['mib_out']:.1f} MiB in {d['seconds']:.1f} s ({types})")


_CONVERT_HELP = f"""Convert a Hugging Face checkpoint directory (safetensors + tokenizer) to GGUF.

Supported: {', '.join(HF_ARCHS)}.
q8_0 / q4_k_m write an f16 GGUF to a temporary file, then quantize it (llama.cpp's mixes)."""


@click.command(help=_CONVERT_HELP)
@click.argument("hf_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path(dir_okay=False))
@click.option("--outtype", type=click.Choice(["f32", "f16", "bf16", "q8_0", "q4_k_m"]), default="f16",
              show_default=True)
@click.option("--threads", "-t", type=click.IntRange(min=1), default=None,
              help="Worker threads for q8_0 / q4_k_m (default: cores).")
@friendly_errors
def convert(hf_dir, dst, outtype, threads):
    """`edgellm convert`; its help text (_CONVERT_HELP) lists the HF architectures of edgellm/architectures.py."""
    from edgellm.errors import UnsupportedModelError

    try:
        from convert import convert_hf
    except ImportError as e:
        raise UnsupportedModelError(f"edgellm convert needs the 'convert' extra (pip install edgellm[convert]): {e}") \
            from None
    if threads is None:
        from kernels_cpu import physical_cores

        threads = physical_cores()
    out = convert_hf(hf_dir, dst, outtype=outtype, progress=sys.stderr.isatty(), threads=threads)
    click.echo(f"{out}: {out.stat().st_size / 2**20:.1f} MiB ({outtype})")
