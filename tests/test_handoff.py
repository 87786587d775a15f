"""kernels_cpu.handoff: spinning helper threads that run split kernel calls."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kernels_cpu import handoff
from kernels_cpu.handoff import publish, run_split, wait_change
from timing import scaled


def _fill(out, value, lo, hi):
    out[lo:hi] = value + np.arange(lo, hi)


def test_every_chunk_runs_once_on_its_own_rows():
    for n in (1, 2, 7, 1000):
        for threads in (2, 3):
            out = np.full(n, -1.0)
            bounds = [n * c // threads for c in range(threads + 1)]
            assert run_split(_fill, bounds, out, 5.0)
            np.testing.assert_array_equal(out, 5.0 + np.arange(n))


def test_many_calls_in_a_row_and_after_the_helpers_slept():
    out = np.zeros(64)
    for i in range(300):
        assert run_split(_fill, [0, 32, 64], out, float(i))
        assert out[63] == i + 63
    deadline = time.monotonic() + 2.0
    while not handoff.helpers(1)[0].sleeping and time.monotonic() < deadline:  # spun out: asleep on its Event
        time.sleep(handoff.SPIN_SECONDS)
    assert handoff.helpers(1)[0].sleeping
    assert run_split(_fill, [0, 32, 64], out, 1000.0)
    np.testing.assert_array_equal(out, 1000.0 + np.arange(64))


def test_a_helpers_exception_reaches_the_caller_and_the_helper_survives():
    def chunk(out, lo, hi):
        if lo > 0:
            raise ValueError("boom in the helper")
        out[lo:hi] = 1

    out = np.zeros(10)
    with pytest.raises(ValueError, match="boom in the helper"):
        run_split(chunk, [0, 5, 10], out)
    assert out[:5].sum() == 5  # the caller's own chunk ran; the helper joined before the raise
    assert run_split(_fill, [0, 5, 10], out, 0.0)
    np.testing.assert_array_equal(out, np.arange(10))


def test_busy_helpers_make_other_threads_fall_back():
    entered, release = threading.Event(), threading.Event()

    def slow(out, lo, hi):
        if lo == 0:
            entered.set()
            release.wait(5)
        out[lo:hi] = 1

    out = np.zeros(4)
    t = threading.Thread(target=run_split, args=(slow, [0, 2, 4], out))
    t.start()
    assert entered.wait(5)
    other = np.zeros(4)
    assert run_split(_fill, [0, 2, 4], other, 0.0) is False  # ran nothing: the caller uses its fallback
    assert not other.any()
    release.set()
    t.join(5)
    np.testing.assert_array_equal(out, 1)


def test_atomic_flags():
    ctrl = np.zeros(2, np.int64)
    assert wait_change(ctrl, 0, 0, 1000) == 0  # no change: gives the old value back after the polls
    publish(ctrl, 1, 7)
    assert wait_change(ctrl, 1, 0, 1000) == 7


@pytest.mark.parametrize("n,threads,cost,want", [
    (10, 2, None, [0, 5, 10]),
    (3, 2, [1, 1, 100], [0, 2, 3]),  # the cut nearest to half the work
    (6, 2, [1] * 6, [0, 3, 6]),
    (4, 3, [5, 0, 0, 0], [0, 0, 1, 4]),
    (8, 2, [1, 2, 3, 4, 5, 6, 7, 8], [0, 6, 8]),  # causal rows: 21 | 15
])
def test_chunk_bounds_split_by_work(n, threads, cost, want):
    from kernels_cpu.parallel import chunk_bounds

    assert chunk_bounds(n, threads, None if cost is None else np.array(cost)) == want


def test_cost_bounds_equal_the_numpy_formula(monkeypatch):
    """The compiled cost split gives the cuts of the NumPy formula it replaced (prefix sums, first bound at or past
    each share, the nearer of it and the one before) on random, fractional, all-zero and causal costs."""
    from kernels_cpu.parallel import chunk_bounds, prange_bounds

    def numpy_cuts(n, threads, cost):
        cum = np.concatenate([[0.0], np.cumsum(np.asarray(cost, dtype=np.float64))])
        target = cum[-1] * np.arange(1, threads) / threads
        hi = np.minimum(np.searchsorted(cum, target, side="left"), n)
        cuts = np.where(cum[hi] - target <= target - cum[np.maximum(hi - 1, 0)], hi, hi - 1)
        return [0, *np.maximum(cuts, 0).tolist(), n]

    rng = np.random.default_rng(7)
    for trial in range(4000):
        n, threads = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        cost = [rng.integers(0, 5, n), rng.random(n), np.zeros(n), np.arange(1.0, n + 1)][trial % 4]
        assert chunk_bounds(n, threads, cost) == numpy_cuts(n, threads, cost), (n, threads, cost)
    from kernels_cpu import parallel

    monkeypatch.setattr(parallel, "prange_team", lambda: 2)  # the prange twins' form, whether or not they are on
    b = prange_bounds(8, 2, np.arange(1, 9))
    assert b.dtype == np.int64 and b.tolist() == [0, 6, 8]


def test_parallel_for_by_cost_covers_every_job_once():
    from kernels_cpu.parallel import parallel_for

    seen = np.zeros(1000, np.int64)

    def kernel(arr, lo, hi, _scratch):
        arr[lo:hi] += 1

    parallel_for(kernel, 1000, 10, lambda: None, seen, cost=np.arange(1000) ** 2)
    assert (seen == 1).all()


def test_prange_twins_equal_python_handoff_and_serial(monkeypatch):
    """The kernels' two ways of splitting work (prange twins on a persistent pool; the Python-level
    hand-off as fallback) and one thread give bit-identical results: matmul, activation quantization,
    row-wise ops and attention."""
    from kernels_cpu import matmul, parallel, prepare_weight, set_threads
    from kernels_cpu.attention import paged_attention
    from kernels_cpu.ops import geglu, rmsnorm, swiglu
    from quant.types import QuantType as Q
    from test_kernels_matmul import random_weight

    rng = np.random.default_rng(5)
    pws = [prepare_weight(random_weight(qt, 96, 512, rng), qt, (96, 512)) for qt in (Q.Q8_0, Q.Q4_K, Q.Q5_1)]
    x = rng.standard_normal((300, 512)).astype(np.float32)
    g, u = rng.standard_normal((2, 300, 64)).astype(np.float32) * 4
    T, P, KVH, H, hd = 200, 200, 2, 4, 32
    k, v = rng.standard_normal((2, 16, 16, KVH, hd)).astype(np.float32)  # 16 blocks of 16 cells
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    bt = rng.permutation(16)[None, :]

    def run():
        return ([matmul(x, pw) for pw in pws] + [rmsnorm(x, x[0], 1e-6), geglu(g, u), swiglu(g, u)]
                + [paged_attention(q, k, v, np.arange(P - T, P), np.zeros(T, np.int64), bt, window=w, scale=0.2)
                   for w in (0, 50)])

    first = run()
    for fast, threads in ((not parallel.FAST_PRANGE, 2), (True, 1)):
        monkeypatch.setattr(parallel, "FAST_PRANGE", fast)
        set_threads(threads)
        try:
            for a, b in zip(run(), first):
                np.testing.assert_array_equal(a, b)
        finally:
            set_threads()


def test_warm_up_runs_in_a_short_lived_thread_and_reraises(monkeypatch):
    """Warm-up must not leave the caller's thread with an OpenMP team (see edgellm.warmup.warm_up)."""
    from edgellm import warmup

    seen = []
    monkeypatch.setattr(warmup, "_warm_up", lambda llm, progress: seen.append(threading.current_thread()))
    warmup.warm_up(object(), progress=False)
    assert seen and seen[0] is not threading.main_thread() and not seen[0].is_alive()

    def boom(llm, progress):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(warmup, "_warm_up", boom)
    with pytest.raises(RuntimeError, match="compile failed"):
        warmup.warm_up(object(), progress=False)


def _forked_child(q):
    from kernels_cpu import matmul, prepare_weight
    from kernels_cpu.ops import rmsnorm
    from quant.types import QuantType as Q
    from test_kernels_matmul import random_weight

    rng = np.random.default_rng(9)
    pw = prepare_weight(random_weight(Q.Q8_0, 512, 512, rng), Q.Q8_0, (512, 512))
    x = rng.standard_normal((200, 512)).astype(np.float32)
    q.put((matmul(x, pw), rmsnorm(x, x[0], 1e-6)))


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork")
def test_kernels_work_in_a_forked_child_after_the_parent_used_them():
    """GNU OpenMP terminates a forked child that launches a parallel region once the parent used one: the
    child falls back to the Python-level hand-off (fresh helper threads) and gets the same results."""
    import multiprocessing as mp

    from kernels_cpu import matmul, prepare_weight
    from kernels_cpu.ops import rmsnorm
    from quant.types import QuantType as Q
    from test_kernels_matmul import random_weight

    rng = np.random.default_rng(9)
    pw = prepare_weight(random_weight(Q.Q8_0, 512, 512, rng), Q.Q8_0, (512, 512))
    x = rng.standard_normal((200, 512)).astype(np.float32)
    want = (matmul(x, pw), rmsnorm(x, x[0], 1e-6))  # the parent splits work first
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_forked_child, args=(q,))
    p.start()
    import queue

    for _ in range(300):
        try:
            got = q.get(timeout=1)
            break
        except queue.Empty:
            assert p.is_alive(), f"the forked child died (exit code {p.exitcode})"
    p.join(30)
    assert p.exitcode == 0
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_prange_bounds_sizes_the_calling_threads_team(monkeypatch):
    """Numba's team size is per launching thread (default: every logical CPU); prange_bounds makes it the
    kernels' thread count in whichever thread launches (e.g. the engine thread)."""
    import numba

    from kernels_cpu import parallel, set_threads

    monkeypatch.setattr(parallel, "FAST_PRANGE", True)
    seen = []

    def run():
        seen.append(numba.get_num_threads())
        seen.append(parallel.prange_bounds(10, 1, np.arange(10)).tolist())
        seen.append(numba.get_num_threads())

    set_threads(1)
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        set_threads()
    assert seen == [numba.config.NUMBA_NUM_THREADS, [0, 10], 1]
    monkeypatch.setattr(parallel, "FAST_PRANGE", False)
    assert parallel.prange_bounds(10, 2) is None


def test_importing_the_kernels_chooses_no_threads():
    """The thread count is chosen explicitly (LLM(threads=...), set_threads) or by the first kernel call,
    not at import: importing starts no Numba team, and the first set_threads decides how splits run."""
    import subprocess
    import sys

    code = ("import numba, kernels_cpu, edgellm\n"
            "try:\n    numba.threading_layer(); print('started')\nexcept ValueError:\n    print('none')\n"
            "from kernels_cpu import parallel, set_threads\n"
            "assert set_threads(1) == 1 and parallel.get_threads() == 1\n"
            "print(numba.threading_layer() if parallel.fast_prange() else 'hand-off')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(300),
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == "none" and lines[1] in ("omp", "tbb", "hand-off"), out.stdout
