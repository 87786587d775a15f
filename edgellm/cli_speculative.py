"""Click options for speculative decoding, shared by generate, chat and serve (the pattern of cli_options.py)."""
from __future__ import annotations

import functools

import click


def speculative_options(fn):
    """--speculative ngram|off and --draft-model PATH. The command gets `speculative`, as LLM(speculative=...)
    takes it: "ngram", "off" or {"draft_model": PATH} (a draft model implies speculation)."""
    opts = [click.option("--speculative", type=click.Choice(["ngram", "off"]), default="ngram", show_default=True,
                         help="Draft tokens by prompt lookup and verify them in one forward (greedy output is "
                              "unchanged; sampled output has the same distribution)."),
            click.option("--draft-model", default=None, metavar="PATH",
                         help="Draft with this small model instead (same vocabulary as the model).")]

    @functools.wraps(fn)
    def wrapper(*args, speculative="ngram", draft_model=None, **kw):
        if draft_model is not None:
            speculative = {"draft_model": draft_model}
        return fn(*args, speculative=speculative, **kw)

    for o in reversed(opts):
        wrapper = o(wrapper)
    return wrapper
