"""Results do not depend on the kernels' thread count: every output element is computed by one thread in a
fixed order (the kernels split work by output rows and jobs, never inside a sum), so the count can change
between steps (kernels_cpu.parallel.set_threads) without changing a token."""
from __future__ import annotations

import itertools

from edgellm import SamplingParams
from edgellm.engine.engine import Engine
from kernels_cpu import get_threads, set_threads


def test_tokens_do_not_depend_on_the_thread_count_of_a_step(gemma_llm):
    """The default model (its matmuls and attention split over 2 threads): greedy tokens and logprobs of 4 streams
    with the thread count alternating 1 / 2 every step equal those at a fixed 2 threads."""
    llm = gemma_llm
    old = get_threads()
    set_threads(2)
    try:
        prompts = [llm.tokenizer.encode(p) for p in ("The capital of France is", "def fib(n):",
                                                      "Once upon a time", "1, 2, 3, 4,")]

        def run(alternate):
            eng = Engine(llm.loaded, llm.model, llm.tokenizer, ctx_size=256, kv_cache_tokens=1024)
            if alternate:  # every forward at the other thread count
                flip, forward = itertools.cycle([1, 2]), eng.runner.run

                def flipped(items):
                    set_threads(next(flip))
                    return forward(items)
                eng.runner.run = flipped
            reqs = [eng.add_request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
                    for p in prompts]
            while eng.has_work():
                eng.step()
            return [(r.output_ids, r.logprobs) for r in reqs]

        want = run(False)
        assert run(True) == want
    finally:
        set_threads(old)
