"""Fast hand-off of kernel calls to helper threads: the helpers spin (without the GIL) for a short while
before sleeping, so a call issued in a busy stretch (one engine step: ~130 matmuls) starts within
microseconds, not the 30-50 µs a ThreadPoolExecutor's wake-up costs.

A batch of 8 decode rows makes each layer matmul 0.1-0.25 ms of work; split over 2 cores with the executor,
a third of the saving went to waking the other thread. The hand-off is used only for calls big enough to
split; idle helpers stop spinning after SPIN_SECONDS and block on an Event.

Protocol per helper (ctrl: int64 array, written with release stores, read with acquire loads):
  ctrl[0] = sequence number of the last job posted, ctrl[1] = of the last job done.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
from numba import types
from numba.extending import intrinsic

from ._jit import jit

SPIN_SECONDS = 0.002  # how long an idle helper spins before it sleeps


@intrinsic
def _load_acquire(typingctx, arr, i):
    """arr[i] of an int64 array as an atomic acquire load (the compiler may not hoist it out of a loop)."""
    if arr != types.Array(types.int64, 1, "C"):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(a.data, [args[1]])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(arr, i), codegen


@intrinsic
def _store_release(typingctx, arr, i, v):
    """arr[i] = v for an int64 array as an atomic release store."""
    if arr != types.Array(types.int64, 1, "C"):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(a.data, [args[1]])
        builder.store_atomic(args[2], ptr, "release", 8)
        return context.get_dummy_value()

    return types.void(arr, i, v), codegen


@jit
def wait_change(ctrl, i, old, max_polls):
    """Poll ctrl[i] until it differs from old (returns the new value) or max_polls polls pass (returns old)."""
    for _ in range(max_polls):
        v = _load_acquire(ctrl, i)
        if v != old:
            return v
    return old


@jit
def publish(ctrl, i, v):
    _store_release(ctrl, i, v)


def _polls_per_second() -> int:
    ctrl = np.zeros(2, np.int64)
    wait_change(ctrl, 0, 0, 1000)
    t = time.perf_counter()
    wait_change(ctrl, 0, 0, 1_000_000)
    return max(1000, int(1_000_000 / max(time.perf_counter() - t, 1e-6)))


class Helper:
    """One helper thread that runs fn(*args) calls handed to it by `start`, finished by `join`."""

    _polls: int | None = None

    def __init__(self, name: str):
        if Helper._polls is None:
            Helper._polls = _polls_per_second()
        self.ctrl = np.zeros(2, np.int64)
        self.seq = 0
        self.job = None
        self.error: BaseException | None = None
        self.sleeping = False
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def start(self, fn, *args) -> None:
        """Hand fn(*args) to the helper (the caller must `join` before the next `start`)."""
        self.job = (fn, args)
        self.seq += 1
        publish(self.ctrl, 0, self.seq)
        if self.sleeping:
            self.wake.set()

    def join(self) -> None:
        """Wait until the last started call has returned; re-raise its exception."""
        while wait_change(self.ctrl, 1, self.seq - 1, 1 << 20) != self.seq:
            pass
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    def _run(self) -> None:
        done = 0
        polls = int(Helper._polls * SPIN_SECONDS)
        while True:
            if wait_change(self.ctrl, 0, done, polls) == done:  # nothing within the spin time: sleep
                self.wake.clear()
                self.sleeping = True
                while wait_change(self.ctrl, 0, done, 1) == done:
                    self.wake.wait(0.05)  # the timeout only guards against a lost wake-up
                self.sleeping = False
                continue
            fn, args = self.job
            try:
                fn(*args)
            except BaseException as e:  # handed back to the caller by join()
                self.error = e
            done += 1
            publish(self.ctrl, 1, done)


_HELPERS: list[Helper] = []
_BUSY = threading.Lock()


def _after_fork_in_child() -> None:
    global _BUSY, _HANDOFF_S
    _HELPERS.clear()  # their threads do not exist in a forked child: start new ones on first use
    _BUSY = threading.Lock()
    _HANDOFF_S = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def helpers(n: int) -> list[Helper]:
    """The first n helper threads (started on first use)."""
    while len(_HELPERS) < n:
        _HELPERS.append(Helper(f"edgellm-helper-{len(_HELPERS)}"))
    return _HELPERS[:n]


def run_split(fn, bounds: list[int], *args) -> bool:
    """fn(*args, bounds[c], bounds[c+1]) for each chunk c: chunk 0 on the calling thread, the others on
    helpers. Returns False, having run nothing, when another thread is using the helpers (the caller then
    uses its fallback)."""
    if not _BUSY.acquire(blocking=False):
        return False
    try:
        hs = helpers(len(bounds) - 2)
        started = []
        try:
            for c, h in enumerate(hs, start=1):
                h.start(fn, *args, bounds[c], bounds[c + 1])
                started.append(h)
            fn(*args, bounds[0], bounds[1])
        finally:
            for h in started:
                h.join()
    finally:
        _BUSY.release()
    return True


@jit
def _noop(a, lo, hi):
    a[lo] = a[hi - 1]


_HANDOFF_S: float | None = None


def handoff_seconds() -> float:
    """Median wall time of one empty run_split over 2 chunks, measured once (0.0 when a split cannot run).

    It is host-dependent: a few µs where a waiting thread wakes quickly, ~50 µs on a VM where each
    GIL hand-over between the caller and a helper goes through a slow futex wake-up. Callers split work
    only when it saves more than this."""
    global _HANDOFF_S
    if _HANDOFF_S is None:
        a = np.zeros(2)
        _noop(a, 0, 2)
        ts = []
        for _ in range(60):
            t = time.perf_counter()
            if not run_split(_noop, [0, 1, 2], a):
                return 0.0  # helpers busy (another thread splitting): measure on a later call
            ts.append(time.perf_counter() - t)
        _HANDOFF_S = float(np.median(ts[10:]))
    return _HANDOFF_S
