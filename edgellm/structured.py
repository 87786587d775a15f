"""Constrained decoding with llguidance: grammar compilation, the GGUF tokenizer as an llguidance tokenizer, and a
per-request matcher that masks disallowed tokens (NumPy bit masks, no torch).

Flow: SamplingParams(json_schema= / regex= / choices= / grammar=) compiles and validates the grammar at once
(`compile_grammar`, raising InvalidRequestError); the engine builds one `GrammarMatcher` per request, fills its
token mask (`fill_mask`, usually on a worker thread while the batch's forward runs), applies it to the logits
(`apply`) and the scheduler advances it with the sampled token (`accept`, which says whether the output is
complete). When the grammar is complete and admits nothing but end-of-sequence (or rejected the token), the
scheduler finishes the request with reason "stop". Matchers never write request state.
"""
from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from edgellm.errors import InvalidRequestError

JSON_OBJECT_SCHEMA = {"type": "object"}  # response_format {"type": "json_object"}: any JSON object
# compact JSON by default (bounded length, fewer tokens); a schema's "x-guidance" key overrides these
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (registers the submodule)
    except ImportError as e:  # pragma: no cover - depends on the install
        raise InvalidRequestError("structured output needs llguidance: pip install 'edgellm[structured]'") from e
    return llguidance


def compile_grammar(*, json_schema: Any = None, regex: str | None = None, choices: list[str] | None = None,
                    grammar: str | None = None) -> str | None:
    """The llguidance grammar (a string) for at most one constraint, validated; None if no constraint.

    json_schema: a dict or a JSON string; regex: Rust regex syntax (the whole output must match);
    choices: list of strings (the output is exactly one of them); grammar: Lark syntax (llguidance dialect) or
    llama.cpp GBNF (recognised by `::=`). Raises InvalidRequestError with the compiler's message if invalid.
    """
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("choices", choices),
                               ("grammar", grammar)) if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(f"give at most one of json_schema, regex, choices, grammar (got {sorted(given)})")
    (kind, spec), = given.items()
    llg = _llg()
    try:
        if kind == "json_schema":
            if isinstance(spec, str):
                spec = json.loads(spec)
            if isinstance(spec, bool) and spec:
                spec = JSON_OBJECT_SCHEMA
            if not isinstance(spec, dict):
                raise InvalidRequestError("json_schema must be a JSON object (dict or JSON string)")
            g = llg.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS)
        elif kind == "regex":
            if not isinstance(spec, str):
                raise InvalidRequestError("regex must be a string")
            g = llg.LLMatcher.grammar_from_regex(spec)
        elif kind == "choices":
            if (not isinstance(spec, (list, tuple)) or not spec
                    or not all(isinstance(c, str) and c for c in spec)):
                raise InvalidRequestError("choices must be a non-empty list of non-empty strings")
            g = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        else:
            if not isinstance(spec, str) or not spec.strip():
                raise InvalidRequestError("grammar must be a non-empty string (Lark or GBNF)")
            g = llg.grammar_from("gbnf" if "::=" in spec else "lark", spec)
    except InvalidRequestError:
        raise
    except (ValueError, TypeError) as e:  # bad JSON text, GBNF that does not convert
        raise InvalidRequestError(f"invalid {kind}: {e}") from None
    return _validated(llg, g, kind)


def _validated(llg, g: str, kind: str) -> str:
    err = llg.LLMatcher.validate_grammar(g)
    if err:
        raise InvalidRequestError(f"invalid {kind}: {err.strip()}")
    return g


def compile_lark(text: str) -> str:
    """The validated llguidance grammar of a Lark text (never read as GBNF); raises InvalidRequestError."""
    llg = _llg()
    try:
        g = llg.grammar_from("lark", text)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"invalid grammar: {e}") from None
    return _validated(llg, g, "grammar")


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads: token bytes (control tokens as b"\\xff<name>", as llguidance's
    llama.cpp adapter does, so grammars never produce them by accident), EOS/BOS and an encode function."""

    def __init__(self, tok):
        self._tok = tok
        n = tok.vocab_size
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i in range(n) if tok.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [b"\xff" + tok.tokens[i].encode("utf-8", "surrogateescape") if i in special
                       else tok.token_to_piece(i) for i in range(n)]

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tok.encode(text, add_bos=False, add_eos=False, special=False)


_ll_lock = threading.Lock()


def ll_tokenizer(tok, n_vocab: int | None = None):
    """The llguidance tokenizer for an edgellm Tokenizer, built once (~2 s for a 262k vocab) and cached on it."""
    with _ll_lock:
        cached = getattr(tok, "_ll_tokenizer", None)
        if cached is None:
            llg = _llg()
            eos = sorted(tok.stop_ids) or ([tok.eos_id] if tok.eos_id is not None else None)
            cached = llg.LLTokenizer(llg.TokenizerWrapper(_TokenizerView(tok)), n_vocab=n_vocab or tok.vocab_size,
                                     eos_token=eos)
            tok._ll_tokenizer = cached
        return cached


class GrammarMatcher:
    """One request's grammar state: the next-token mask and the tokens consumed so far."""

    def __init__(self, ll_tok, grammar: str):
        llg = _llg()
        self.m = llg.LLMatcher(ll_tok, grammar, log_level=0)
        if self.m.is_error():
            raise InvalidRequestError(f"invalid grammar: {self.m.get_error()}")
        self.n_vocab = ll_tok.vocab_size
        self.mask = np.full((-(-self.n_vocab // 32),), -1, dtype=np.int32)  # (ceil(V/32),) 1 bit per token
        self.mask_ready = False

    def fill_mask(self) -> None:
        """Compute the allowed-token mask for the current state (drops the GIL: run it beside the forward)."""
        self.m.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        self.mask_ready = True

    def allowed(self) -> np.ndarray:
        """(V,) bool: tokens the grammar allows next."""
        if not self.mask_ready:
            self.fill_mask()
        return np.unpackbits(self.mask.view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of (V',) logits with disallowed tokens at -inf (ids past the grammar's vocab are disallowed)."""
        ok = self.allowed()
        out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
        n = min(len(ok), len(logits))
        out[:n] = np.where(ok[:n], logits[:n], -np.inf)
        return out

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False if the grammar rejected it (the matcher is then in an error state)."""
        self.mask_ready = False
        return self.m.consume_token(int(token))

    def accept(self, token: int) -> bool:
        """Advance with the token the request just appended; True if the output is complete (the grammar
        admits only end-of-sequence now, or rejected the token)."""
        return not self.advance(token) or self.done

    @property
    def done(self) -> bool:
        """The output is complete: the grammar admits nothing more but end-of-sequence (or failed)."""
        return self.m.is_stopped()

    @property
    def error(self) -> str:
        return self.m.get_error()


class TokenSequence:
    """A 'grammar' that forces exactly these token ids (then stops): with temperature 0 and logprobs=0 the engine
    records the model's log-probability of each forced token, which scores a continuation (program `select`).
    Set it as `params.compiled_grammar = TokenSequence(ids)` on a fresh SamplingParams."""

    def __init__(self, ids: list[int]):
        if not ids:
            raise InvalidRequestError("a forced token sequence must not be empty")
        self.ids = [int(t) for t in ids]


class ForcedMatcher:
    """GrammarMatcher's interface over a TokenSequence: the only allowed token is the next one in the list."""

    def __init__(self, ids: list[int]):
        self.ids, self.pos = ids, 0

    def fill_mask(self) -> None:
        pass

    def apply(self, logits: np.ndarray) -> np.ndarray:
        out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
        t = self.ids[self.pos]
        out[t] = logits[t]
        return out

    def accept(self, token: int) -> bool:
        """Advance past the forced token; True once every token of the sequence is out."""
        self.pos += 1
        return self.pos >= len(self.ids)


def make_matcher(compiled, tokenizer):
    """The per-request matcher for SamplingParams.compiled_grammar (an llguidance grammar, a TokenSequence or an
    object with a `matcher(tokenizer)` method)."""
    if isinstance(compiled, TokenSequence):
        return ForcedMatcher(compiled.ids)
    if hasattr(compiled, "matcher"):  # a composite constraint (reasoning.ReasoningGrammar) builds its own
        return compiled.matcher(tokenizer)
    return GrammarMatcher(ll_tokenizer(tokenizer), compiled)


class MaskWorker:
    """One background thread that fills the grammar masks of a step while the batch's forward runs."""

    def __init__(self):
        self._pool = None

    def start(self, matchers: list[GrammarMatcher]):
        if not matchers:
            return None
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="edgellm-mask")
        return self._pool.submit(lambda: [m.fill_mask() for m in matchers])

    @staticmethod
    def wait(future) -> None:
        if future is not None:
            future.result()
