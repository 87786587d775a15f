"""EngineLoop: every handle ends (output, its own error, EngineStoppedError after shutdown, EngineDeadError when
the engine thread fails), submit() refuses once the loop no longer serves, Ctrl-C is not swallowed, result()
times out. Each test runs its own loop over a fresh engine on the tiny model, so a killed engine harms no one."""
from __future__ import annotations

import threading
import time

import pytest

from edgellm import LLM, SamplingParams
from edgellm.engine.engine import Engine
from edgellm.engine.loop import EngineLoop
from edgellm.errors import EngineDeadError, EngineStoppedError

GREEDY = dict(temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, **GREEDY)
LONG = SamplingParams(max_tokens=200, **GREEDY)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    return LLM(tiny_model("llama"), ctx_size=256, progress=False)


@pytest.fixture
def loop(tiny_llm):
    eng = Engine(tiny_llm.loaded, tiny_llm.model, tiny_llm.tokenizer, ctx_size=256, kv_cache_tokens=512)
    lp = EngineLoop(eng)
    yield lp
    lp.shutdown()


def within(seconds: float, fn):
    """fn()'s result or the exception it raised (returned, not raised), run in a thread; fails if it hangs."""
    box: list = []

    def run():
        try:
            box.append(fn())
        except BaseException as e:  # KeyboardInterrupt too: it must not reach pytest's thread
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert box, f"still blocked after {seconds} s"
    return box[0]


def first_piece(h):
    return next(h.pieces())


def test_submit_after_shutdown_raises_at_once(loop):
    assert loop.submit([1, 2, 3], SHORT).result(60).finish_reason == "length"
    loop.shutdown()
    t = time.perf_counter()
    got = within(10, lambda: loop.submit([1, 2, 3], SHORT).result(5))
    assert isinstance(got, EngineStoppedError), got
    assert time.perf_counter() - t < 1.0
    assert isinstance(loop.error, EngineStoppedError)


def test_shutdown_ends_running_and_waiting_handles(loop):
    # 3 x 203 tokens do not fit in 512 KV tokens together: one of them is still waiting at the shutdown
    hs = [loop.submit([1, 2, 3 + i], LONG) for i in range(3)]
    within(60, lambda: first_piece(hs[0]))
    loop.shutdown()
    for h in hs:
        got = within(10, lambda: list(h.pieces()))
        assert isinstance(got, EngineStoppedError), got
        assert isinstance(within(1, lambda: h.result(0)), EngineStoppedError)


def test_an_error_escaping_step_kills_the_engine_visibly(loop, monkeypatch):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("engine bug")

    monkeypatch.setattr(loop.engine, "step", broken)
    with loop.step_lock:  # both are in before the first step fails
        hs = [loop.submit([1, 2, 3 + i], SHORT) for i in range(2)]
    for h in hs:
        got = within(10, lambda: h.result(5))
        assert isinstance(got, EngineDeadError), got
        assert isinstance(got.__cause__, RuntimeError)
    assert len(calls) == 1  # not stepped again after the failure
    assert isinstance(loop.error, EngineDeadError)
    assert isinstance(within(5, lambda: loop.submit([1, 2], SHORT)), EngineDeadError)
    assert isinstance(within(5, lambda: loop.call(lambda: 1)), EngineDeadError)


def test_keyboard_interrupt_in_the_engine_thread_is_not_swallowed(loop, monkeypatch):
    real, raised = loop.engine.step, []

    def interrupted():
        if not raised:
            raised.append(1)
            raise KeyboardInterrupt
        return real()

    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_type))
    monkeypatch.setattr(loop.engine, "step", interrupted)
    h = loop.submit([1, 2, 3], SHORT)
    got = within(10, lambda: h.result(5))
    assert isinstance(got, EngineDeadError), got  # the caller is not left waiting
    deadline = time.time() + 5
    while not seen and time.time() < deadline:
        time.sleep(0.01)
    assert seen == [KeyboardInterrupt]  # and the interrupt left the thread instead of being caught


def test_result_timeout_raises_timeout_error(loop):
    h = loop.submit([1, 2, 3], LONG)
    with pytest.raises(TimeoutError):
        h.result(timeout=0.001)
    h.cancel()
    assert h.result(60).finish_reason == "cancelled"


def test_a_failing_listener_does_not_stop_the_engine(loop):
    def bad(h, piece):
        raise ValueError("listener bug")

    h = loop.submit([1, 2, 3], SHORT, listener=bad)
    assert h.result(60).finish_reason == "length"
    assert loop.error is None
    assert loop.submit([1, 2, 4], SHORT).result(60).finish_reason == "length"


def test_listener_sees_every_piece_then_the_end(loop):
    seen = []
    h = loop.submit([1, 2, 3], SamplingParams(max_tokens=6, **GREEDY), listener=lambda h, p: seen.append(p))
    out = h.result(60)
    assert seen[-1] is None and "".join(seen[:-1]) == out.text
    assert list(h.pieces()) == seen[:-1]
    assert list(h.pieces()) == []  # a second iteration ends at once
