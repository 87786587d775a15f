"""Write a 1B-class benchmark model (random weights: speed does not depend on them) and quantize it to Q4_K_M with
`edgellm quantize`, the size people run on laptops.

    python benchmarks/make_bench_model.py [llama-1b | qwen3moe-1b] [--out DIR] [--type q4_k_m]
    python benchmarks/vs_llamacpp.py --model DIR/llama-1b-random-q4_k_m.gguf

llama-1b: Llama 3.2 1B's shape: d_model 2048, 16 layers, 32 heads / 8 KV heads (head_dim 64), d_ff 8192, vocab
128256, tied embeddings (F16 file 2.5 GB).
qwen3moe-1b: Qwen3-30B-A3B's design scaled to ~1.3B weights: d_model 1024, 16 layers, 16 / 4 heads of 128, 48 experts
of width 512, 8 routed per token (~0.3B weights read per token), vocab 151936.
The F16 file is written once and kept next to the quantized one; both are reused when present.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the random-weight GGUF writer the tests use

MODELS = {  # name -> (arch, tiny_models.write_tiny_model keywords)
    "llama-1b": ("llama", dict(n_vocab=128256, d_model=2048, d_ff=8192, n_head=32, n_kv_head=8, head_dim=64,
                               n_layer=16, context_length=4096, tie_embeddings=True, rope_freq_base=500000.0)),
    "qwen3moe-1b": ("qwen3moe", dict(n_vocab=151936, d_model=1024, d_ff=3072, n_head=16, n_kv_head=4, head_dim=128,
                                     n_layer=16, context_length=4096, n_expert=48, n_expert_used=8, expert_ff=512)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="llama-1b", choices=sorted(MODELS))
    ap.add_argument("--out", default=str(Path.home() / ".cache" / "edgellm" / "bench"))
    ap.add_argument("--type", default="q4_k_m")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    arch, shape = MODELS[a.model]
    f16 = out / f"{a.model}-random-f16.gguf"
    dst = out / f"{a.model}-random-{a.type.lower()}.gguf"
    if not f16.exists():
        from tiny_models import write_tiny_model

        t = time.perf_counter()
        print(f"writing {f16} (random F16 weights) ...", flush=True)
        tmp = f16.with_suffix(".part")
        write_tiny_model(tmp, arch, qtype="F16", **shape)
        tmp.rename(f16)
        print(f"  {f16.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True)
    if not dst.exists():
        tmp = dst.with_suffix(".part")
        subprocess.run([sys.executable, "-m", "edgellm.cli", "quantize", "--type", a.type, str(f16), str(tmp)],
                       check=True, cwd=ROOT)
        tmp.rename(dst)
    print(dst)


if __name__ == "__main__":
    main()
