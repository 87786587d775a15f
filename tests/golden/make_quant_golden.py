"""Golden per-tensor types and sha256 of llama.cpp's own quantizer output on tiny F32 models.

    python tests/golden/make_quant_golden.py     # needs llama-cpp-python (the `bench` extra)

For each tiny model (tests/tiny_models.py) and each llama.cpp ftype, runs `llama_model_quantize` (no imatrix)
and records {tensor: [type name, sha256 of the tensor bytes]} in tests/golden/quant_golden.json.
tests/test_quantize.py rebuilds the same F32 models, quantizes them with convert.quantize_model and compares.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent))

from tiny_models import write_tiny_model  # noqa: E402

from edgellm.gguf_file import read_gguf  # noqa: E402

# name -> write_tiny_model keyword arguments (d_ff=384 exercises the not-a-multiple-of-256 fallbacks)
MODELS = {
    "llama": dict(arch="llama", d_model=256, d_ff=512),
    "llama_ff384": dict(arch="llama", d_model=256, d_ff=384),
    "gemma3": dict(arch="gemma3", d_model=256, d_ff=512, n_layer=6),
    "qwen3moe": dict(arch="qwen3moe", d_model=256, d_ff=512),  # 8 experts: llama.cpp's 8-expert rules
}
FTYPES = ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S",
          "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4_MOE"]


def tensor_digests(path) -> dict:
    g = read_gguf(path)
    return {n: [t.qtype.name, hashlib.sha256(bytes(g.tensor_bytes(n))).hexdigest()] for n, t in g.tensors.items()}


def llama_cpp_quantize(src: str, dst: str, ftype: str) -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
    p.nthread = 1
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {ftype}")


def main() -> None:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mname, kw in MODELS.items():
            src = f"{tmp}/{mname}.gguf"
            write_tiny_model(src, **kw)
            out[mname] = {"model": kw, "ftypes": {}}
            for ft in FTYPES:
                dst = f"{tmp}/{mname}-{ft}.gguf"
                llama_cpp_quantize(src, dst, ft)
                out[mname]["ftypes"][ft] = tensor_digests(dst)
    (HERE / "quant_golden.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print("wrote", HERE / "quant_golden.json")


if __name__ == "__main__":
    main()
