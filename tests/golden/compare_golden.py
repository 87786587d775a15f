"""Compare golden files made by another llama.cpp build (make_model_golden.py --out DIR) with the committed ones:
how far llama.cpp's own builds are apart sets the tolerances of the model-level golden tests.

    python tests/golden/compare_golden.py DIR [--json OUT]

Prints the perplexity ratio, the mean |dNLL| per scored token, and per greedy prompt the first step where the
continuations differ with the committed file's top-2 logit gap there.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def main(other: str, out: str | None = None) -> None:
    a = json.loads((HERE / "perplexity_gemma3.json").read_text())
    b = json.loads((Path(other) / "perplexity_gemma3.json").read_text())
    mad = float(np.mean(np.abs(np.asarray(a["nll"]) - np.asarray(b["nll"]))))
    summary = {"other_build": b.get("llama_cpp"), "committed_build": a.get("llama_cpp"),
               "ppl": {"committed": a["ppl"], "other": b["ppl"], "rel": abs(b["ppl"] - a["ppl"]) / a["ppl"],
                       "mean_abs_dnll": mad}, "greedy": []}
    print(f"perplexity: committed {a['ppl']:.4f}, other {b['ppl']:.4f} (rel {abs(b['ppl'] - a['ppl']) / a['ppl']:.2e}); "
          f"mean |dNLL| {mad:.4f}")
    ga = json.loads((HERE / "greedy_gemma3.json").read_text())
    gb = {c["id"]: c for c in json.loads((Path(other) / "greedy_gemma3.json").read_text())["prompts"]}
    same = 0
    for c in ga["prompts"]:
        x, y = c["generated_ids"], gb[c["id"]]["generated_ids"]
        d = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        gaps = [s["gap"] for s in c["steps"]]
        if d is None:
            same += 1
            print(f"  {c['id']:14s} equal ({len(x)} tokens)")
        else:
            print(f"  {c['id']:14s} differs at step {d}: committed gap {gaps[d]:.4f}, smallest gap before "
                  f"{min(gaps[:d], default=float('nan')):.4f}")
        summary["greedy"].append({"id": c["id"], "first_difference": d, "gap_there": None if d is None else gaps[d],
                                  "min_gap_before": None if d is None else min(gaps[:d], default=None)})
    print(f"greedy: {same} of {len(ga['prompts'])} continuations equal")
    if out:
        Path(out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--json" else None)
