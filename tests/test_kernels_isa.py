"""The matmul kernels of every instruction set this host can run, not only its best one: an AVX-512 host also
builds and checks the AVX2, AVX2 + AVX-VNNI and portable kernels (EDGELLM_ISA forces the target of Numba's code
generator, see kernels_cpu/_jit.py), each in a fresh interpreter; and the assembly of each path holds the
instructions it was written for."""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_cpu._jit import FORCED_ISAS, cpu_features

ROOT = Path(__file__).resolve().parent.parent
X86 = platform.machine() in ("x86_64", "AMD64")
pytestmark = pytest.mark.skipif(not X86, reason="forced instruction sets are x86 levels (ARM: see .ci/arm)")


def runnable(isa: str) -> bool:
    return FORCED_ISAS[isa][1] <= cpu_features()


def _env(isa: str) -> dict:
    return dict(os.environ, EDGELLM_ISA=isa)


# The reference and exact-integer tests of test_kernels_matmul, per forced instruction set. The host's own set
# (native) runs the whole file in the main test process.
@pytest.mark.parametrize("isa", ["avx2", "avx2-vnni", "portable"])
def test_matmul_kernels_per_isa(isa):
    if not runnable(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "tests/test_kernels_matmul.py", "-k", "reference or exact"],
                       cwd=ROOT, env=_env(isa), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert re.search(r"\d+ passed", r.stdout), r.stdout[-500:]


ASM_PROBE = r"""
import re, sys
import numpy as np
from kernels_cpu import prepare_weight
from kernels_cpu.matmul import _prepare_x
from kernels_cpu.matmul_driver import make_driver
from quant.types import QuantType as Q
qt = Q[sys.argv[1]]
k = 256
rng = np.random.default_rng(0)
raw = rng.integers(0, 256, (16, k // 256 * 144 if qt == Q.Q4_K else k // 32 * 34), dtype=np.uint8)
pw = prepare_weight(raw, qt, (16, k))
run = make_driver(int(qt), cache=False)
xq, dx, bs = _prepare_x(np.ones((1, k), np.float32), pw)
run(np.empty((1, 16), np.float32), xq, dx, bs, pw.qs, pw.sc, 0, 1)
print(run.inspect_asm(run.signatures[0]))
"""


def _asm(isa: str, qt: str) -> str:
    r = subprocess.run([sys.executable, "-c", ASM_PROBE, qt], cwd=ROOT, env=_env(isa), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


# (forced ISA, format) -> instructions the decode kernel must contain; every forced AVX2 build: no zmm register
ASM_EXPECT = {
    ("avx2", "Q4_K"): ("vpmaddubsw", "vpmaddwd"),  # unsigned codes x int8 activations, widened by the scales
    ("avx2", "Q8_0"): ("vpmaddwd",),  # signed weights: int16 pairs
    ("avx2-vnni", "Q4_K"): ("vpmaddubsw",),
    ("avx512-vnni", "Q4_K"): ("vpdpwssd",),
    ("avx512-vnni", "Q8_0"): ("vpdpwssd",),
}


def hot_loop_spills(asm: str, op: str) -> int:
    """Vector register spills (ymm/zmm moved to or from the stack) in the smallest loop that contains `op`:
    the one-activation-row (decode) pass."""
    lines = asm.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^(\.LBB\S+):", l))}
    best = None
    for i, l in enumerate(lines):
        m = re.match(r"^\s+j\w+\s+(\.LBB\S+)", l)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = lines[labels[m.group(1)]:i + 1]
            n_op = sum(bool(re.search(rf"\b{op}\b", b)) for b in body)
            spills = sum(bool(re.search(r"%[yz]mm\d+", b) and "(%rsp)" in b) for b in body)
            if n_op and (best is None or n_op < best[0]):
                best = (n_op, spills)
    assert best is not None, f"no loop with {op}"
    return best[1]


@pytest.mark.parametrize("isa,qt", list(ASM_EXPECT), ids=lambda v: str(v))
def test_decode_kernel_instructions(isa, qt):
    if not runnable(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    asm = _asm(isa, qt)
    for op in ASM_EXPECT[isa, qt]:
        assert re.search(rf"\b{op}\b", asm), f"{isa} {qt}: no {op}"
    assert hot_loop_spills(asm, ASM_EXPECT[isa, qt][0]) == 0, f"{isa} {qt}: vector spills in the decode loop"
    if isa.startswith("avx2"):
        assert "zmm" not in asm, f"{isa} {qt}: an AVX-512 register in an AVX2 build"
    assert "vpmuldq" not in asm  # the int64-widening fallback that plain Numba loops give
