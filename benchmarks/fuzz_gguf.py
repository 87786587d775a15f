"""Long run of the GGUF mutation fuzzer (tests/gguf_fuzzer.py; the suite runs 2,100 cases of it).

    nice -n 19 python benchmarks/fuzz_gguf.py --mutations 20000 --seed 1

Mutations are shared among the targets (tiny llama, tiny gemma3, BPE vocabulary: 3 : 3 : 2). Every mutated file is
loaded, tokenized, its chat template rendered and, when that works, its model built and run for one token,
whatever its tensor types (kernels of a type are compiled on its first appearance). Prints the outcome counts
per target and in total, the time, any case slower than 2 s, and every unnamed exception with its seed and case
(gguf_fuzzer.mutate(target.base, seed, case) rebuilds the file). Exit status 1 if there was one.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import gguf_fuzzer as F  # noqa: E402

SHARES = {"llama": 3, "gemma3": 3, "bpe-vocab": 2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutations", type=int, default=20000, help="total number of mutated files")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--targets", default=",".join(SHARES), help="comma-separated subset of " + ", ".join(SHARES))
    args = ap.parse_args(argv)
    os.environ.setdefault("EDGELLM_WEIGHT_CACHE", "0")  # thousands of files: cache no repacked weights
    logging.getLogger("edgellm").setLevel(logging.ERROR)  # dropped out-of-range token ids warn
    wanted = args.targets.split(",")
    report = F.Report()
    with tempfile.TemporaryDirectory(prefix="fuzz_gguf_") as d:
        targets = [t for t in F.targets(d) if t.name in wanted]
        total_share = sum(SHARES[t.name] for t in targets)
        t0 = time.perf_counter()
        for k, target in enumerate(targets):
            n = args.mutations * SHARES[target.name] // total_share
            seed = args.seed * 10 + k
            t1 = time.perf_counter()
            F.run(target, Path(d) / f"mutated_{target.name}.gguf", seed=seed, cases=range(n), report=report)
            counts = report.per_target.get(target.name, {})
            print(f"{target.name:10s} seed {seed:4d}  {n:6d} cases  {time.perf_counter() - t1:7.1f} s  "
                  + ", ".join(f"{o}: {c}" for o, c in sorted(counts.items(), key=lambda kv: -kv[1])), flush=True)
        elapsed = time.perf_counter() - t0
    n_total = sum(report.counts.values())
    print(f"total      {n_total} cases in {elapsed:.1f} s ({1000 * elapsed / max(n_total, 1):.1f} ms per case)")
    for outcome, count in sorted(report.counts.items(), key=lambda kv: -kv[1]):
        print(f"  {outcome:28s} {count:7d}  {100 * count / max(n_total, 1):5.1f} %")
    for name, seed, case, what, seconds in report.slow:
        print(f"slow: {name} seed={seed} case={case} {seconds:.1f} s: {what}")
    for name, seed, case, what, err in report.failures:
        print(f"UNNAMED: {name} seed={seed} case={case}: {what} -> {err}")
    print(f"unnamed exceptions: {len(report.failures)}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
