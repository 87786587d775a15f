"""The NEON kernels run, not only compiled: qdot's IR for an aarch64 CPU (kernels_cpu.matmul_ir.qdot_module, as
tests/test_kernels_isa.py compiles it) is linked into a small static C program by the aarch64 cross compiler and
run under qemu-user as a Raspberry Pi 5 CPU (Cortex-A76, dotprod) and a Pi 4 CPU (Cortex-A72, none); its outputs
for one row group equal the host kernels' bit for bit (exact integer sums, the same float operations per row).

Needs qemu-aarch64-static and aarch64-linux-gnu-gcc (Debian: qemu-user-static, gcc-aarch64-linux-gnu; .ci/run
installs them); each test fails without them. On an aarch64 host tests/test_kernels_matmul.py runs these kernels directly."""
from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kernels_cpu import matmul, prepare_weight
from kernels_cpu.matmul import _prepare_x
from quant.types import FORMATS
from quant.types import QuantType as Q
from test_kernels_matmul import random_weight
from timing import scaled

QEMU, GCC = shutil.which("qemu-aarch64-static"), shutil.which("aarch64-linux-gnu-gcc")
pytestmark = pytest.mark.skipif(platform.machine() == "aarch64",
                                reason="cross-runs aarch64 code from another host; test_kernels_matmul runs it here")


@pytest.fixture(autouse=True)
def _cross_tools():
    assert QEMU and GCC, ("needs qemu-aarch64-static and aarch64-linux-gnu-gcc: apt-get install qemu-user-static "
                          "gcc-aarch64-linux-gnu (.ci/run does)")


A64 = "aarch64-unknown-linux-gnu"
NEON = frozenset({"fp-armv8", "neon"})
CPUS = {"cortex-a76": NEON | {"dotprod"}, "cortex-a72": NEON}
ROWS = 3  # activation rows of the compiled pass

HARNESS = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
void qdot(void *, void *, void *, void *, void *, void *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
static void *slurp(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = malloc(n + 64);
    if (fread(p, 1, n, f) != (size_t)n) exit(3);
    fclose(f);
    return p;
}
int main(int argc, char **argv) {  /* argv: dir K nbx nbs NB QB SB BS */
    int64_t a[7];
    for (int i = 0; i < 7; i++) a[i] = atoll(argv[2 + i]);
    double facc[8 * 16];
    qdot(facc, slurp(argv[1], "xq"), slurp(argv[1], "dx"), slurp(argv[1], "bs"), slurp(argv[1], "qs"),
         slurp(argv[1], "sc"), 0, a[0], 0, a[1], 0, a[2], 0, 0, a[3], a[4], a[5], a[6]);
    char path[4096];
    snprintf(path, sizeof path, "%s/facc", argv[1]);
    FILE *f = fopen(path, "wb");
    fwrite(facc, sizeof(double), 8 * 16, f);
    fclose(f);
    return 0;
}
"""


def _program(tmp: Path, qt: Q, cpu: str) -> Path:
    """A static aarch64 executable of qdot for qt (ROWS rows, int8 activations) built for cpu."""
    import llvmlite.binding as ll

    from kernels_cpu import matmul_iq, matmul_k, matmul_q  # noqa: F401 - register the bodies
    from kernels_cpu.matmul_ir import qdot_module

    ll.initialize_all_targets()
    ll.initialize_all_asmprinters()
    feats = CPUS[cpu]
    tm = ll.Target.from_triple(A64).create_target_machine(cpu="generic", opt=3, reloc="pic",
                                                          features=",".join(f"+{f}" for f in sorted(feats)))
    mod = ll.parse_assembly(str(qdot_module(int(qt), ROWS, "int8", A64, feats)))
    mod.triple, mod.data_layout = A64, str(tm.target_data)
    mod.verify()
    pb = ll.create_pass_builder(tm, ll.create_pipeline_tuning_options(speed_level=3))
    pb.getModulePassManager().run(mod, pb)
    obj, src, exe = tmp / f"qdot_{qt.name}_{cpu}.o", tmp / "harness.c", tmp / f"run_{qt.name}_{cpu}"
    obj.write_bytes(tm.emit_object(mod))
    src.write_text(HARNESS)
    subprocess.run([GCC, "-O1", "-static", str(src), str(obj), "-o", str(exe)], check=True, capture_output=True)
    return exe


@pytest.mark.parametrize("cpu", sorted(CPUS))
@pytest.mark.parametrize("qt", [Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4], ids=lambda q: q.name)
def test_neon_kernel_runs_like_the_host_kernel(tmp_path, qt, cpu):
    rng = np.random.default_rng(70 + int(qt))
    k = 512
    raw = random_weight(qt, 16, k, rng)  # one row group
    pw = prepare_weight(raw, qt, (16, k))
    x = rng.standard_normal((ROWS, k)).astype(np.float32)
    x[1] = np.where(np.arange(k) % 3, -60.0, 60.0)  # codes +-127
    want = matmul(x, pw)  # (ROWS, 16)
    xq, dx, bs = _prepare_x(x, pw)
    assert xq.dtype == np.int8
    for name, arr in {"xq": xq, "dx": dx, "bs": bs, "qs": pw.qs, "sc": pw.sc}.items():
        (tmp_path / name).write_bytes(np.ascontiguousarray(arr).tobytes())
    nb, qb, sb = pw.qs.shape[1], pw.qs.shape[2], pw.sc.shape[2]
    exe = _program(tmp_path, qt, cpu)
    args = [k, dx.shape[1], bs.shape[1], nb, qb, sb, k // nb]
    subprocess.run([QEMU, "-cpu", cpu, str(exe), str(tmp_path), *map(str, args)], check=True, timeout=scaled(120))
    got = np.fromfile(tmp_path / "facc", np.float64).reshape(8, 16)[:ROWS].astype(np.float32)
    assert FORMATS[qt].block_size * nb == k
    np.testing.assert_array_equal(got, want)
