"""Mutation fuzz of tiny GGUF files (tests/gguf_fuzzer.py): a corrupt file gives a named error, never a traceback.

2,100 seeded mutations of the metadata and the tensor table (bit flips, wrong types, wrong lengths, huge counts,
edge values, dropped / repeated keys, broken tensor entries, truncation) of a tiny llama, a tiny gemma3 and a BPE
vocabulary. Each file is loaded, tokenized, its chat template rendered, its vocabulary detokenized and, if all of
that works, the model is built and runs one token. The only acceptable outcomes are an EdgeLLMError subclass or
a working model. EDGELLM_FUZZ_SEED picks another seed; benchmarks/fuzz_gguf.py runs the same fuzzer longer.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import gguf_fuzzer as F
from timing import scaled

SEED = int(os.environ.get("EDGELLM_FUZZ_SEED", "17"))
CASES = {"llama": 900, "gemma3": 700, "bpe-vocab": 500}  # 2,100 mutations, ~15 s on two cores


@pytest.fixture(scope="module")
def fuzz_targets(tmp_path_factory):
    return F.targets(tmp_path_factory.mktemp("fuzz"))


def test_mutated_files_give_named_errors_or_work(fuzz_targets, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGELLM_WEIGHT_CACHE", "0")  # thousands of files: repack in memory, cache nothing
    caplog.set_level(logging.ERROR, logger="edgellm")  # out-of-range token ids are dropped with a warning
    report = F.Report()
    for k, target in enumerate(fuzz_targets):
        unmutated = tmp_path / f"{target.name}.gguf"
        unmutated.write_bytes(target.base.image)
        assert F.exercise(str(unmutated), model=target.model) == "ok"  # compiles the base types' kernels
        F.run(target, tmp_path / f"mutated_{target.name}.gguf", seed=SEED * 10 + k, cases=range(CASES[target.name]),
              forward_types=F.base_types(target, tmp_path), report=report)
    print(f"seed {SEED}: {sorted(report.counts.items(), key=lambda kv: -kv[1])}")
    assert sum(report.counts.values()) >= 2000
    found = "\n".join(f"{name} seed={seed} case={case}: {what} -> {err}" for name, seed, case, what, err
                      in report.failures[:30])
    assert not report.failures, f"{len(report.failures)} mutations gave an unnamed exception " \
                                f"(gguf_fuzzer.mutate(base, seed, case) rebuilds one):\n{found}"
    assert not [s for s in report.slow if s[-1] > 10], f"slow cases: {report.slow}"
    # the fuzz is not vacuous: corrupt files are refused and intact-enough ones run
    assert report.counts.get("GGUFError", 0) > 500 and report.counts.get("ok", 0) > 200, report.counts


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *args], capture_output=True, text=True, timeout=scaled(300))


@pytest.mark.parametrize("case", ["token_type_scalar", "huge_token_count", "flipped_bits"])
def test_corrupt_file_cli_info_one_line_exit_2(fuzz_targets, tmp_path, case):
    base = fuzz_targets[0].base
    if case == "token_type_scalar":
        data = base.with_value("tokenizer.ggml.token_type", F.T.UINT32, 1)
    elif case == "huge_token_count":
        data = F.huge_count_of(base, "tokenizer.ggml.tokens", 2**40)
    else:
        data = F.mutate(base, seed=3, case=_first_refused(base, tmp_path))[0]
    bad = tmp_path / "BAD.gguf"
    bad.write_bytes(data)
    r = _cli("info", "--model", str(bad))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("edgellm: error:"), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def _first_refused(base: F.BaseFile, tmp_path) -> int:
    """The first bit-flip case of seed 3 that the loader refuses with GGUFError."""
    from edgellm.errors import GGUFError
    from edgellm.loader import load_gguf

    path = tmp_path / "probe.gguf"
    for case in range(1000):
        data, what = F.mutate(base, seed=3, case=case)
        if not what.startswith("flip_metadata"):
            continue
        path.write_bytes(data)
        try:
            load_gguf(str(path))
        except GGUFError:
            return case
    raise AssertionError("no refused bit flip in 1000 cases")
