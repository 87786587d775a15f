"""Constrained decoding on the default model (issue 8 figures).

    python benchmarks/structured.py [--model GGUF] [--threads 2] [--n 50] [--new 64]

1. --n generations (temperature 0.8) spread over the 5 JSON schemas of tests/test_structured.py, submitted in
   batches: every output must parse, validate with jsonschema and end with the JSON (finish reason "stop").
2. 8 constrained requests in one batch (JSON schemas that cannot close within --new tokens, so the batch stays
   full) vs 8 unconstrained ones (ignore_eos): aggregate tokens/s, and their ratio (target >= 0.8).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import jsonschema  # noqa: E402

from edgellm import LLM, SamplingParams  # noqa: E402
from test_structured import SCHEMAS  # noqa: E402

LONG = [  # outputs that keep going: a long string, a long array of small objects
    {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}}, "required": ["story"]},
    {"type": "array", "minItems": 200, "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"], "additionalProperties": False}},
]


def aggregate_tps(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    return n / dt, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--new", type=int, default=64)
    a = ap.parse_args()
    llm = LLM(a.model, threads=a.threads, progress=False)

    # 1. validity under schemas
    t0 = time.perf_counter()
    prompts, params, schemas = [], [], []
    for i in range(a.n):
        prompt, schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(prompt)
        params.append(SamplingParams(json_schema=schema, temperature=0.8, max_tokens=160, seed=1000 + i))
        schemas.append(schema)
    outs = llm.generate(prompts, params)
    ok = 0
    for o, schema in zip(outs, schemas):
        try:
            jsonschema.validate(json.loads(o.text), schema)
            ok += o.finish_reason == "stop"
        except (ValueError, jsonschema.ValidationError) as e:
            print(f"INVALID ({e.__class__.__name__}): {o.text!r}")
    n_tok = sum(len(o.token_ids) for o in outs)
    print(f"schemas: {ok}/{a.n} outputs valid and complete ({n_tok} tokens, {time.perf_counter() - t0:.1f} s)")

    # 2. 8 constrained vs 8 free in one batch (warm: the llguidance tokenizer is built by part 1)
    free = [SamplingParams(max_tokens=a.new, temperature=0.8, seed=i, ignore_eos=True) for i in range(8)]
    cons = [SamplingParams(json_schema=LONG[i % 2], max_tokens=a.new, temperature=0.8, seed=i, ignore_eos=True)
            for i in range(8)]
    p8 = ["Write a JSON document:\n"] * 8
    aggregate_tps(llm, p8[:2], free[:2])  # warm-up
    tf, nf = aggregate_tps(llm, p8, free)
    tc, nc = aggregate_tps(llm, p8, cons)
    print(f"8 unconstrained: {tf:.1f} tok/s ({nf} tokens); 8 constrained: {tc:.1f} tok/s ({nc} tokens); "
          f"ratio {tc / tf:.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()
