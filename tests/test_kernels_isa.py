"""The matmul kernels of every instruction set this host can run, not only its best one: an AVX-512 host also
builds and checks the AVX2, AVX2 + AVX-VNNI and portable kernels (EDGELLM_ISA forces the target of Numba's code
generator, see kernels_cpu/_jit.py), each in a fresh interpreter; and the assembly of each path holds the
instructions it was written for. The AArch64 NEON kernels' assembly is checked on every host by compiling their
IR for an aarch64 target with llvmlite (Cortex-A76 with dotprod, Cortex-A72 without); on aarch64 also as Numba
builds them for the CPU it runs on (.ci/arm runs this file under qemu for both CPU models, whose own kernels
then pass tests/test_kernels_matmul.py)."""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_cpu._jit import X86_ISAS, cpu_features
from timing import scaled

ROOT = Path(__file__).resolve().parent.parent
X86 = platform.machine() in ("x86_64", "AMD64")
ARM = platform.machine().lower() in ("aarch64", "arm64")
x86_only = pytest.mark.skipif(not X86, reason="x86 instruction sets (ARM: the NEON tests below)")


def runnable(isa: str) -> bool:
    return X86_ISAS[isa][1] <= cpu_features()


def _env(isa: str) -> dict:
    return dict(os.environ, EDGELLM_ISA=isa)


# The reference, exact-integer and batch-invariance tests of test_kernels_matmul, per forced instruction set (a
# path's forms for few and many rows must give the same bits). The host's own set
# (native) runs the whole file in the main test process.
@x86_only
@pytest.mark.parametrize("isa", ["avx2", "avx2-vnni", "portable"])
def test_matmul_kernels_per_isa(isa):
    if not runnable(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "tests/test_kernels_matmul.py", "-k", "reference or exact or invariance"],
                       cwd=ROOT, env=_env(isa), capture_output=True, text=True, timeout=scaled(900))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert re.search(r"\d+ passed", r.stdout), r.stdout[-500:]


ASM_PROBE = r"""
import re, sys
import numpy as np
from kernels_cpu import prepare_weight
from kernels_cpu.matmul import _prepare_x
from kernels_cpu.matmul_driver import make_driver
from quant.types import FORMATS, QuantType as Q
qt = Q[sys.argv[1]]
k = 256
rng = np.random.default_rng(0)
raw = rng.integers(0, 256, (16, k // FORMATS[qt].block_size * FORMATS[qt].type_size), dtype=np.uint8)
pw = prepare_weight(raw, qt, (16, k))
run = make_driver(int(qt), cache=False)
xq, dx, bs = _prepare_x(np.ones((1, k), np.float32), pw)
run(np.empty((1, 16), np.float32), xq, dx, bs, pw.qs, pw.sc, 0, 1)
print(run.inspect_asm(run.signatures[0]))
"""


def _asm(isa: str, qt: str) -> str:
    r = subprocess.run([sys.executable, "-c", ASM_PROBE, qt], cwd=ROOT, env=_env(isa), capture_output=True,
                       text=True, timeout=scaled(600))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


# (forced ISA, format) -> instructions the decode kernel must contain; every forced AVX2 build: no zmm register
ASM_EXPECT = {
    # the k-quants' quad vectors (matmul_kquad): unsigned codes x int8 activation quads, vpdpbusd where VNNI
    # exists, else vpmaddubsw widened by the sub-block scales with vpmaddwd
    ("avx2", "Q4_K"): ("vpmaddubsw", "vpmaddwd"),
    ("avx2", "Q5_K"): ("vpmaddubsw", "vpmaddwd"),
    ("avx2", "Q6_K"): ("vpmaddubsw", "vpmaddwd"),
    ("avx2", "Q8_0"): ("vpmaddwd",),  # signed weights: int16 pairs
    # the 32-block nibble formats' quad vectors on AVX2 (repack.QUAD_32), as the k-quants'
    ("avx2", "Q4_0"): ("vpmaddubsw", "vpmaddwd"),
    ("avx2", "Q5_0"): ("vpmaddubsw", "vpmaddwd"),
    ("avx2", "Q3_K"): ("vpmaddubsw", "vpmaddwd"),
    ("avx2-vnni", "Q4_K"): ("vpdpbusd",),
    ("avx2-vnni", "Q6_K"): ("vpdpbusd",),
    ("avx512", "Q4_K"): ("vpmaddubsw", "vpmaddwd"),
    ("avx512", "Q6_K"): ("vpmaddubsw", "vpmaddwd"),
    ("avx512-vnni", "Q4_K"): ("vpdpbusd",),
    ("avx512-vnni", "Q5_K"): ("vpdpbusd",),
    ("avx512-vnni", "Q6_K"): ("vpdpbusd",),
    ("avx512-vnni", "Q3_K"): ("vpdpbusd",),
    # Q8_0 as quads of codes + 128 where vpdpbusd exists (repack.QUAD_32), as the nibble formats' quads
    ("avx512-vnni", "Q8_0"): ("vpdpbusd",),
    ("avx2-vnni", "Q8_0"): ("vpdpbusd",),
    # the 32-block nibble formats' quads with AVX-512 too (16-row slices)
    ("avx512-vnni", "Q4_0"): ("vpdpbusd",),
    ("avx512-vnni", "Q5_0"): ("vpdpbusd",),
    # the table-lookup formats (matmul_iq): codes -> int8 weights by vpshufb, then 4-product dots per row (the
    # first instruction, once per row and quad, finds the one-row loop)
    ("avx512-vnni", "IQ4_NL"): ("vpdpbusd", "vpshufb"),
    ("avx512-vnni", "IQ4_XS"): ("vpdpbusd", "vpshufb"),
    ("avx512-vnni", "MXFP4"): ("vpdpbusd", "vpshufb"),
    ("avx2-vnni", "IQ4_XS"): ("vpdpbusd", "vpshufb"),
    ("avx2", "IQ4_NL"): ("vpmaddubsw", "vpshufb", "vpsignb", "vpmaddwd"),  # |w| x sign(x, w), as ggml on AVX2
    ("avx2", "IQ4_XS"): ("vpmaddubsw", "vpshufb", "vpsignb", "vpmaddwd"),
    ("avx512", "MXFP4"): ("vpmaddubsw", "vpshufb", "vpmaddwd"),
}

# AVX2's 16 ymm registers: LLVM keeps IQ4_NL's nibble mask in a stack slot and reloads it once per block
SPILL_LIMIT = {("avx2", "IQ4_NL"): 1}
# instructions of the decode loop per instruction of its multiply-add (the first of ASM_EXPECT), at most: Q5_0's
# fifth bits by shifts of one bit-plane vector (its pair-vector layout took a broadcast, shuffle, compare and mask
# per pair: 15 a vpmaddubsw, now 10.5)
DENSITY_LIMIT = {("avx2", "Q5_0"): 12}


X86_JUMP = r"^\s+j\w+\s+(\.LBB\S+)"
A64_BRANCH = r"^\s+(?:b(?:\.\w+)?|cbn?z\s+\w+,|tbn?z\s+\w+,\s*#\d+,)\s+(\.LBB\S+)"


def hot_loop(asm: str, op: str, branch: str = X86_JUMP) -> list[str]:
    """The smallest loop (a backward `branch` to a label) that contains `op`: the one-activation-row (decode)
    pass."""
    lines = asm.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^(\.LBB\S+):", l))}
    best = None
    for i, l in enumerate(lines):
        m = re.match(branch, l)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = lines[labels[m.group(1)]:i + 1]
            n_op = sum(bool(re.search(rf"\b{op}\b", b)) for b in body)
            if n_op and (best is None or n_op < best[0]):
                best = (n_op, body)
    assert best is not None, f"no loop with {op}"
    return best[1]


def hot_loop_spills(asm: str, op: str) -> int:
    """Vector register spills (ymm/zmm moved to or from the stack) in the x86 decode loop that contains `op`."""
    return sum(bool(re.search(r"%[yz]mm\d+", b) and "(%rsp)" in b) for b in hot_loop(asm, op))


@x86_only
@pytest.mark.parametrize("isa,qt", list(ASM_EXPECT), ids=lambda v: str(v))
def test_decode_kernel_instructions(isa, qt):
    if not runnable(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    asm = _asm(isa, qt)
    for op in ASM_EXPECT[isa, qt]:
        assert re.search(rf"\b{op}\b", asm), f"{isa} {qt}: no {op}"
    limit = SPILL_LIMIT.get((isa, qt), 0)
    assert hot_loop_spills(asm, ASM_EXPECT[isa, qt][0]) <= limit, f"{isa} {qt}: vector spills in the decode loop"
    if (isa, qt) in DENSITY_LIMIT:
        loop = [l for l in hot_loop(asm, ASM_EXPECT[isa, qt][0]) if re.match(r"^\s+[a-z]", l)]
        n_op = sum(bool(re.search(rf"\b{ASM_EXPECT[isa, qt][0]}\b", l)) for l in loop)
        assert len(loop) <= DENSITY_LIMIT[isa, qt] * n_op, f"{isa} {qt}: {len(loop)} instructions for {n_op}"
    # decode streams each weight from memory: the block step prefetches ahead (kernels_cpu.matmul_ir.PREFETCH_BYTES)
    assert re.search(r"\bprefetcht1\b", asm), f"{isa} {qt}: no prefetch of the weights ahead"
    if qt.endswith("_K"):  # spread over the super-block's run loop (the decode loop), not one burst a block
        loop = hot_loop(asm, ASM_EXPECT[isa, qt][0])
        assert any(re.search(r"\bprefetcht1\b", l) for l in loop), f"{isa} {qt}: no prefetch in the run loop"
    if isa.startswith("avx2"):
        assert "zmm" not in asm, f"{isa} {qt}: an AVX-512 register in an AVX2 build"
    assert "vpmuldq" not in asm  # the int64-widening fallback that plain Numba loops give


@x86_only
def test_avx2_q8_0_many_rows_pass_without_spills():
    """Q8_0 with int16 activations on AVX2 takes both 8-row slices of a group in one pass of 4 activation rows, as a
    loop over the 16 pairs (matmul_q._joint_sums): each step widens the two slices' pair vectors once and loads each
    row's pair broadcast once for both (8 vpmaddwd, 2 vpmovsxbw, 4 vpbroadcastd), with no spill. The slice-by-slice
    passes loaded every broadcast twice with an address add each (36 instructions a step for 128 products; now 25);
    unrolled, LLVM hoisted all 16 widenings and spilled ~90 vectors per block."""
    if not runnable("avx2"):
        pytest.skip("this CPU cannot run avx2")
    r = subprocess.run([sys.executable, "-c", ASM_PROBE.replace("(1, k)", "(8, k)").replace("(1, 16)", "(8, 16)"),
                        "Q8_0"], cwd=ROOT, env=_env("avx2"), capture_output=True, text=True, timeout=scaled(600))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^(\.LBB\S+):", l))}
    loops = [lines[labels[m.group(1)]:i + 1] for i, l in enumerate(lines)
             if (m := re.match(X86_JUMP, l)) and labels.get(m.group(1), i) < i]
    # the pair loops: loops with no other block inside that multiply (LLVM unrolls the 2-row pass's twice)
    inner = [b for b in loops if count(b, r"\bvpmaddwd\b") and count(b[1:], r"^\.LBB") == 0]
    assert inner, "no pair loop"
    for body in inner:
        assert count(body, r"%ymm\d+.*\(%rsp\)|\(%rsp\).*%ymm\d+") == 0, "vector spills in a pair loop"
    # the 4-row pass: one vpmaddwd per row and slice, one widening per slice, one broadcast per row
    four = [(count(b, r"\bvpmaddwd\b"), count(b, r"\bvpmovsxbw\b"), count(b, r"\bvpbroadcastd\b")) for b in inner]
    assert (8, 2, 4) in four, f"no 4-row joint pair loop (vpmaddwd, vpmovsxbw, vpbroadcastd per loop: {four})"


# -- AArch64 NEON ------------------------------------------------------------------------------------------------
A64 = "aarch64-unknown-linux-gnu"
NEON = frozenset({"fp-armv8", "neon"})
# LLVM CPU and features of a Raspberry Pi 5 (Cortex-A76: dotprod) and a Pi 4 (Cortex-A72: none) as _jit tells
# Numba on aarch64: the generic CPU with the features the kernel reports
NEON_TARGETS = {"dotprod": ("generic", NEON | {"dotprod"}), "no-dotprod": ("generic", NEON)}
# the default model's matmul formats (Q4_K_M of Gemma 3 270M: Q5_0 / Q4_K / Q6_K layers, Q8_0 output head): no
# spill in their hot loop; the others (bit planes of Q5_K / Q3_K / Q5_1 without dotprod) a few per block
HOT_FORMATS = ("Q4_K", "Q6_K", "Q8_0", "Q5_0")


def aarch64_asm(qt: str, rows: int, cpu: str, feats: frozenset[str], kernel_feats: frozenset[str] | None = None,
                xdtype: str = "int8") -> str:
    """Assembly of the kernels' qdot IR (int8 activations, as NEON takes them) for an aarch64 CPU with LLVM
    features feats (the kernels' bodies chosen for kernel_feats, default the same), compiled and optimized (O3)
    by llvmlite on whatever host runs the test."""
    import llvmlite.binding as ll

    from kernels_cpu import matmul_iq, matmul_k, matmul_q  # noqa: F401 - register the bodies
    from kernels_cpu.matmul_ir import qdot_module
    from quant.types import QuantType as Q

    ll.initialize_all_targets()
    ll.initialize_all_asmprinters()
    tm = ll.Target.from_triple(A64).create_target_machine(cpu=cpu, features=",".join(f"+{f}" for f in sorted(feats)),
                                                          opt=3)
    kf = feats if kernel_feats is None else kernel_feats
    mod = ll.parse_assembly(str(qdot_module(int(Q[qt]), rows, xdtype, A64, kf)))
    mod.triple, mod.data_layout = A64, str(tm.target_data)
    mod.verify()
    pb = ll.create_pass_builder(tm, ll.create_pipeline_tuning_options(speed_level=3))
    pb.getModulePassManager().run(mod, pb)
    return tm.emit_assembly(mod)


def count(lines, pattern: str) -> int:
    return sum(bool(re.search(pattern, l)) for l in lines)


SP_ACCESS = r"\[sp\b"  # a load or store to the stack (a spill or reload, in a loop)
MUL32 = r"\b(?:mul|mla|mls)\s+v\d+\.4s"  # a 32-bit vector multiply


def check_neon_asm(asm: str, dotprod: bool, qt: str) -> None:
    """The decode kernel's NEON instructions: sdot in a spill-free hot loop with dotprod; without it widening
    multiply-accumulates (smull / smlal, sadalp) and no 32-bit vector multiply anywhere."""
    if dotprod:
        assert re.search(r"\bsdot\b", asm), f"{qt}: no sdot"
        loop = hot_loop(asm, "sdot", A64_BRANCH)
    else:
        assert not re.search(r"\b[su]dot\b", asm), f"{qt}: a dot-product instruction without dotprod"
        assert re.search(r"\bsmlal2?\b", asm) and re.search(r"\bsmull2?\b", asm), f"{qt}: no smull / smlal"
        assert count(asm.splitlines(), MUL32) == 0, f"{qt}: 32-bit vector multiplies without dotprod"
        loop = hot_loop(asm, "smlal", A64_BRANCH)
        if qt in ("Q8_0", "Q4_0", "Q5_0"):  # no sub-block scales: each row's int16 lanes added by sadalp
            assert count(loop, r"\bsa(?:da|dd)lp\b"), f"{qt}: no sadalp / saddlp"
    assert re.search(r"\bprfm\s+pldl2keep\b", asm), f"{qt}: no prefetch of the weights ahead"
    limit = 0 if qt in HOT_FORMATS else 16
    assert count(loop, SP_ACCESS) <= limit, f"{qt}: stack accesses in the hot loop:\n" + "\n".join(loop)
    assert not re.search(r"^\s+bl\s", "\n".join(loop), re.M), f"{qt}: a call (a runtime routine) in the hot loop"


NEON_CASES = [(qt, t) for qt in ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q5_K", "Q3_K", "Q2_K") for t in NEON_TARGETS]


@pytest.mark.parametrize("qt,target", NEON_CASES, ids=lambda v: str(v))
def test_neon_decode_kernel_assembly(qt, target):
    """The NEON decode kernel (one activation row) compiled for a Pi 5 and a Pi 4 CPU, on any host."""
    cpu, feats = NEON_TARGETS[target]
    check_neon_asm(aarch64_asm(qt, 1, cpu, feats), target == "dotprod", qt)


IQ_NEON = ("IQ4_NL", "IQ4_XS", "MXFP4")


@pytest.mark.parametrize("qt", IQ_NEON)
def test_neon_iq_decode_kernel_assembly(qt):
    """The table-lookup formats on a Pi 5 CPU: codes -> int8 by tbl, then sdot, no spill or call in the hot loop;
    on a Pi 4 CPU (no dotprod) tbl, then widening multiplies (smull, addp, sadalp), no 32-bit multiply but
    IQ4_XS's sub-block scale."""
    asm = aarch64_asm(qt, 1, *NEON_TARGETS["dotprod"])
    assert re.search(r"\btbl\b", asm) and re.search(r"\bsdot\b", asm), f"{qt}: no tbl / sdot"
    loop = hot_loop(asm, "sdot", A64_BRANCH)
    assert count(loop, SP_ACCESS) == 0, f"{qt}: stack accesses in the hot loop:\n" + "\n".join(loop)
    assert not re.search(r"^\s+bl\s", "\n".join(loop), re.M), f"{qt}: a call in the hot loop"
    asm = aarch64_asm(qt, 1, *NEON_TARGETS["no-dotprod"])
    assert re.search(r"\btbl\b", asm) and not re.search(r"\b[su]dot\b", asm)
    loop = hot_loop(asm, "smull", A64_BRANCH)  # smull + addp + sadalp per 4 rows and quad
    assert count(loop, r"\bsadalp\b") and count(loop, SP_ACCESS) == 0, "\n".join(loop)
    if qt != "IQ4_XS":
        assert count(loop, MUL32) == 0, f"{qt}: 32-bit multiplies"


def test_neon_asm_checks_can_fail():
    """The portable IR (no NEON feature in the kernels' set) compiled for the same CPU fails the checks: LLVM
    gives neither sdot nor only widening multiplies by itself."""
    cpu, feats = NEON_TARGETS["no-dotprod"]
    asm = aarch64_asm("Q4_K", 1, cpu, feats, kernel_feats=frozenset(), xdtype="int16")
    with pytest.raises(AssertionError):
        check_neon_asm(asm, False, "Q4_K")
    with pytest.raises(AssertionError):
        check_neon_asm(asm, True, "Q4_K")


@pytest.mark.skipif(not ARM, reason="Numba's own build for the CPU it runs on: aarch64 only (elsewhere the cross "
                                    "builds above)")
def test_native_neon_decode_kernel():
    """On aarch64, Numba's build of the Q4_K decode driver for this CPU: the kernels see the CPU's features
    (from the auxiliary vector; under qemu LLVM's own detection sees none), and LLVM is told them, so the driver
    holds sdot where the CPU has dotprod and widening multiply-accumulates where not."""
    import numba

    from kernels_cpu._jit import host_features

    feats = cpu_features()
    assert "neon" in feats and "neon" in host_features()
    dot = "dotprod" in feats
    assert ("+dotprod" in (numba.config.CPU_FEATURES or "")) == dot
    check_neon_asm(_asm("native", "Q4_K"), dot, "Q4_K")


def test_hwcap_bits_to_llvm_features():
    from kernels_cpu.hwcap import AT_HWCAP, AT_HWCAP2, features_from_auxv

    # a Cortex-A76 (Pi 5): fp, asimd, asimdhp, asimddp; a Neoverse V1 adds sve and (HWCAP2) i8mm, bf16
    assert features_from_auxv({AT_HWCAP: 0b1 | 0b10 | 1 << 10 | 1 << 20}) == {"fp-armv8", "neon", "fullfp16",
                                                                               "dotprod"}
    assert features_from_auxv({AT_HWCAP: 1 << 22, AT_HWCAP2: 1 << 13 | 1 << 14}) == {"sve", "i8mm", "bf16"}
    assert features_from_auxv({AT_HWCAP: 0b11}) == {"fp-armv8", "neon"}  # a Cortex-A72 (Pi 4): no dotprod


@pytest.mark.skipif(not (ARM and platform.system() == "Linux"),
                    reason="Linux aarch64's auxiliary vector (x86 glibc rewrites AT_HWCAP with its own bits)")
def test_auxv_file_agrees_with_getauxval():
    from kernels_cpu.hwcap import _auxv_file, _getauxval

    assert _getauxval() == _auxv_file()


def test_forced_isa_is_told_to_llvm_and_checked(monkeypatch):
    """EDGELLM_ISA sets Numba's target to the forced set, and refuses a set this CPU lacks, naming what."""
    import numba

    from kernels_cpu import _jit

    name, (cpu, feats) = max(_jit.FORCED_ISAS.items(), key=lambda kv: len(kv[1][1]))
    monkeypatch.setattr(numba.config, "CPU_NAME", numba.config.CPU_NAME)
    monkeypatch.setattr(numba.config, "CPU_FEATURES", numba.config.CPU_FEATURES)
    monkeypatch.setenv("EDGELLM_ISA", name)
    monkeypatch.setattr(_jit, "cpu_features", lambda: feats)
    assert _jit._force_isa() == feats
    assert numba.config.CPU_NAME == cpu and set(numba.config.CPU_FEATURES.split(",")) == {f"+{f}" for f in feats}
    lacking = sorted(feats)[0]
    monkeypatch.setattr(_jit, "cpu_features", lambda: feats - {lacking})
    with pytest.raises(ValueError, match=f"lacks {lacking}"):
        _jit._force_isa()
