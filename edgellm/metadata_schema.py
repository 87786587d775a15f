"""One schema for every GGUF metadata key edgellm reads: type, shape, length and range, checked once at load.

The loader (``{arch}.*`` hyper-parameters, ``general.*``), the tokenizer (``tokenizer.ggml.*``) and the chat
template (``tokenizer.chat_template``) read only values that passed :func:`check_metadata`; a value of the wrong
type, an array of the wrong length or a number out of range raises ``GGUFError`` with one line naming the key,
before any reader touches it. ``KEYS`` is the registry (data); ``INVARIANTS`` the few rules that relate keys.

Integer keys accept any GGUF integer width and float keys any integer or float type (writers differ); a bool,
string or array where a number belongs is an error. Special-token ids out of the vocabulary are dropped with a
warning, as llama.cpp keeps its default id then. Metadata read by ``gguf.GGUFReader.contents()`` (plain lists)
passes the same checks as metadata read by ``edgellm.gguf_file`` (NumPy arrays, ``StringArray``).
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT
from gguf import GGUFValueType as T

from edgellm.errors import GGUFError, UnsupportedModelError

log = logging.getLogger("edgellm.metadata")

_FLOATS = frozenset({T.FLOAT32, T.FLOAT64})
U32_MAX = 2**32 - 1


@dataclass(frozen=True)
class Key:
    """What one metadata key must hold.

    ``name`` may contain ``{arch}``. ``vtype`` is the GGUF type writers use (``ARRAY`` with ``elem`` for arrays);
    ``per_layer`` keys hold a scalar or an array of one value per layer. ``length`` names the quantity an array's
    length must equal (``n_tokens``, ``n_layers``, ``n_vocab``; unknown quantities are not checked). ``lo``/``hi``
    are inclusive bounds of a number (of every element of a per-layer array; of an ``ARRAY``'s length), numbers
    or names (a quantity in ``QUANTITIES``, or a key whose checked value bounds this one).
    ``required`` lists the scopes that cannot do without the key. ``on_range="drop"`` treats an out-of-range
    value as absent (with a warning) instead of failing.
    """

    name: str
    vtype: T
    scope: str  # "general" | "model" | "tokenizer"
    elem: T | None = None
    per_layer: bool = False
    length: str | None = None
    lo: float | str | None = None
    hi: float | str | None = None
    lo_open: bool = False  # lo itself is excluded (positive floats)
    allow_inf: bool = False  # floats: +-inf accepted (NaN never is)
    max_len: int | None = None  # strings: characters
    rule: str | None = None  # a name in RULES
    elem_kinds: str | None = None  # NumPy dtype kinds an array may have (default: from elem)
    required: tuple[str, ...] = ()
    on_range: str = "error"  # "error" | "drop"
    defines: str | None = None  # the quantity this key fixes: its value (block_count) or its length (tokens)


def _u32(name, scope, **kw) -> Key:
    return Key(name, T.UINT32, scope, **kw)


def _f32(name, scope, **kw) -> Key:
    return Key(name, T.FLOAT32, scope, **kw)


def _token_id(name: str) -> Key:
    return _u32(name, "tokenizer", lo=0, hi="max_token_id", on_range="drop")


_POSITIVE = dict(lo=0.0, lo_open=True)
KEYS: tuple[Key, ...] = (  # order matters: a key that defines a quantity comes before the keys that use it
    Key("general.architecture", T.STRING, "general", max_len=128, required=("model",)),
    Key("general.name", T.STRING, "general", max_len=1 << 16),
    _u32("general.file_type", "general", lo=0, hi=U32_MAX),
    _u32("general.alignment", "general", lo=1, hi=1 << 30, rule="power_of_two"),
    # per-architecture hyper-parameters (loader.config_from_metadata)
    _u32("{arch}.block_count", "model", lo=1, hi="max_layers", required=("model",), defines="n_layers"),
    _u32("{arch}.context_length", "model", lo=1, hi=2**31 - 1, required=("model",)),
    _u32("{arch}.embedding_length", "model", lo=1, hi=1 << 20, required=("model",)),
    _u32("{arch}.feed_forward_length", "model", per_layer=True, lo=1, hi=1 << 24, required=("model",)),
    _u32("{arch}.attention.head_count", "model", per_layer=True, lo=1, hi=1 << 14, required=("model",)),
    _u32("{arch}.attention.head_count_kv", "model", per_layer=True, lo=1, hi="{arch}.attention.head_count"),
    _u32("{arch}.attention.key_length", "model", lo=1, hi=1 << 16),
    _u32("{arch}.attention.value_length", "model", lo=1, hi=1 << 16),
    _f32("{arch}.attention.layer_norm_rms_epsilon", "model", **_POSITIVE, hi=1.0, required=("model",)),
    _u32("{arch}.attention.sliding_window", "model", lo=0, hi=2**31 - 1),
    _u32("{arch}.attention.sliding_window_pattern", "model", per_layer=True, lo=0, hi=1 << 16, elem_kinds="iub"),
    _f32("{arch}.rope.freq_base", "model", **_POSITIVE),
    _f32("{arch}.rope.freq_base_swa", "model", **_POSITIVE),
    _u32("{arch}.rope.dimension_count", "model", lo=1, hi=1 << 16),
    Key("{arch}.rope.scaling.type", T.STRING, "model", max_len=64),
    _f32("{arch}.rope.scaling.factor", "model", lo=0.0),
    _f32("{arch}.rope.scaling.attn_factor", "model", **_POSITIVE),
    _u32("{arch}.rope.scaling.original_context_length", "model", lo=1, hi=2**31 - 1),
    _u32("{arch}.expert_count", "model", lo=0, hi=1 << 12),
    _u32("{arch}.expert_used_count", "model", lo=0, hi="{arch}.expert_count"),
    _u32("{arch}.expert_feed_forward_length", "model", lo=1, hi=1 << 24),
    _f32("{arch}.attn_logit_softcapping", "model", lo=0.0),
    _f32("{arch}.final_logit_softcapping", "model", lo=0.0),
    # vocabulary (tokenizer.Tokenizer) and chat template (chat_template.ChatTemplate.from_metadata)
    Key("tokenizer.ggml.model", T.STRING, "tokenizer", max_len=64, required=("tokenizer",)),
    Key("tokenizer.ggml.tokens", T.ARRAY, "tokenizer", elem=T.STRING, length="n_vocab", lo=1,
        required=("tokenizer",), defines="n_tokens"),
    Key("tokenizer.ggml.scores", T.ARRAY, "tokenizer", elem=T.FLOAT32, length="n_tokens", allow_inf=True),
    Key("tokenizer.ggml.token_type", T.ARRAY, "tokenizer", elem=T.INT32, length="n_tokens"),
    Key("tokenizer.ggml.merges", T.ARRAY, "tokenizer", elem=T.STRING),
    Key("tokenizer.ggml.pre", T.STRING, "tokenizer", max_len=256),
    *(_token_id(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding", "eot", "eom",
                                                          "fim_pad", "fim_rep", "fim_sep")),
    *(Key(f"tokenizer.ggml.{k}", T.BOOL, "tokenizer") for k in ("add_bos_token", "add_eos_token",
                                                                "add_space_prefix")),
    Key("tokenizer.chat_template", T.STRING, "tokenizer", max_len=1 << 20),
)
SCOPES = ("general", "model", "tokenizer")
QUANTITIES = {  # how a length or bound quantity reads in a message
    "n_tokens": "one per token (tokenizer.ggml.tokens)", "n_layers": "one per layer ({arch}.block_count)",
    "n_vocab": "the rows of token_embd.weight", "max_token_id": "the last token id",
    "max_layers": "the number of tensors",
}
RULES: dict[str, tuple[Callable[[int], bool], str]] = {
    "power_of_two": (lambda v: v & (v - 1) == 0, "a power of two"),
}


class CheckedMetadata(dict):
    """GGUF metadata whose values passed the schema for ``scopes`` (a plain dict otherwise)."""

    def __init__(self, items: Mapping, scopes: Collection[str]):
        super().__init__(items)
        self.scopes = frozenset(scopes)


class _Context:
    """Quantities and checked values the bounds and lengths of later keys refer to."""

    def __init__(self, meta: Mapping, tensors: Mapping | None, path: str):
        self.meta, self.path, self.arch = meta, path, ""  # meta: the values checked so far (bounds read them)
        self.q: dict[str, Any] = {"max_layers": 1 << 16}
        if tensors is not None:
            self.q["max_layers"] = min(1 << 16, max(len(tensors), 1))
            emb = tensors.get("token_embd.weight")
            if emb is not None and len(emb.shape) == 2:
                self.q["n_vocab"] = emb.shape[0]

    def key(self, name: str) -> str:
        return name.format(arch=self.arch)

    def resolve(self, bound):
        if bound is None or not isinstance(bound, str):
            return bound
        if bound in self.q:
            return self.q[bound]
        return self.meta.get(self.key(bound))

    @property
    def prefix(self) -> str:
        return f"{self.path}: " if self.path else ""

    def fail(self, key: str, problem: str) -> GGUFError:
        return GGUFError(f"{self.prefix}metadata key {key!r} {problem}")

    def missing(self, key: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.prefix}missing metadata key {key!r}")


def check_metadata(meta: Mapping, tensors: Mapping | None = None, *, path: str = "",
                   scopes: Collection[str] = SCOPES, need: Collection[str] = ("model",),
                   archs: Collection[str] | None = None) -> CheckedMetadata:
    """Check every present key of ``scopes`` (and the presence of the keys ``need``'s scopes require).

    ``tensors`` (name -> TensorInfo) lets lengths and bounds refer to the tensor table (the vocabulary is the rows
    of token_embd.weight, a model has fewer layers than tensors). ``archs``: supported ``general.architecture``
    values (else UnsupportedModelError). Returns the metadata, out-of-range special-token ids dropped.
    """
    out = dict(meta)
    ctx = _Context(out, tensors, path)
    for key in KEYS:  # general.architecture first: it names the {arch} keys
        if key.scope not in scopes or ("{arch}" in key.name and "model" not in scopes):
            continue
        _check_key(key, ctx, out, need)
        if key.name == "general.architecture" and "model" in scopes:
            ctx.arch = out["general.architecture"]
            if archs is not None and ctx.arch not in archs:
                raise UnsupportedModelError(f"{ctx.prefix}unsupported architecture {ctx.arch!r} "
                                            f"(supported: {', '.join(archs)})")
    for inv in INVARIANTS:
        if inv.scope in scopes:
            inv.check(ctx, out)
    return CheckedMetadata(out, scopes)


def check_tokenizer_metadata(meta: Mapping, *, path: str = "") -> CheckedMetadata:
    """Metadata fit for building a tokenizer: ``meta`` itself if it was checked at load, else checked now."""
    if isinstance(meta, CheckedMetadata) and "tokenizer" in meta.scopes:
        for key in KEYS:
            if "tokenizer" in key.required and key.name not in meta:
                raise _Context(meta, None, path).missing(key.name)
        return meta
    return check_metadata(meta, path=path, scopes=("general", "tokenizer"), need=("tokenizer",))


def alignment(meta: Mapping, path: str = "") -> int:
    """The file's checked ``general.alignment`` (the reader needs it before the tensor table is placed)."""
    out = dict(meta)
    _check_key(_BY_NAME["general.alignment"], _Context(meta, None, path), out, ())
    return int(out.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))


def _check_key(key: Key, ctx: _Context, out: dict, need: Collection[str]) -> None:
    name = ctx.key(key.name)
    if name not in out:
        if any(s in need for s in key.required):
            raise ctx.missing(name)
        return
    v = out[name]
    if key.vtype == T.ARRAY or (key.per_layer and not _is_scalar(v)):
        n = _check_array(key, name, v, ctx)
    else:
        n = None
        _check_scalar(key, name, v, ctx)
    if not _in_range(key, name, v, ctx, out):
        return
    if key.defines == "n_tokens":
        ctx.q["n_tokens"], ctx.q["max_token_id"] = n, n - 1
    elif key.defines:
        ctx.q[key.defines] = int(v)


def _is_scalar(v) -> bool:
    return isinstance(v, (int, float, str, bytes, np.generic))


def _kind(v) -> str:
    """A short description of a value's type for messages."""
    if isinstance(v, (bool, np.bool_)):
        return "a bool"
    if isinstance(v, (int, np.integer)):
        return "an integer"
    if isinstance(v, (float, np.floating)):
        return "a float"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, np.ndarray):
        return f"an array of {v.size} {v.dtype.name}"
    if hasattr(v, "__len__"):
        return f"an array of {len(v)} values"
    return type(v).__name__


def _expect(vtype: T) -> str:
    return {T.STRING: "a string", T.BOOL: "a bool"}.get(vtype, "a float" if vtype in _FLOATS else "an integer")


def _check_scalar(key: Key, name: str, v, ctx: _Context) -> None:
    is_bool = isinstance(v, (bool, np.bool_))
    if key.vtype == T.STRING:
        ok = isinstance(v, str)
    elif key.vtype == T.BOOL:
        ok = is_bool
    elif key.vtype in _FLOATS:
        ok = isinstance(v, (int, float, np.integer, np.floating)) and not is_bool
    else:
        ok = isinstance(v, (int, np.integer)) and not is_bool
    if not ok:
        raise ctx.fail(name, f"must be {_expect(key.vtype)}{' (or one per layer)' if key.per_layer else ''}, "
                             f"got {_kind(v)}")
    if key.vtype == T.STRING and key.max_len is not None and len(v) > key.max_len:
        raise ctx.fail(name, f"is longer than {key.max_len} characters ({len(v)})")
    if key.vtype in _FLOATS and not (math.isfinite(v) or (key.allow_inf and not math.isnan(v))):
        raise ctx.fail(name, f"must be finite, got {float(v)}")


def _check_array(key: Key, name: str, v, ctx: _Context) -> int:
    """Element type and length of an array value (a per-layer key's array form); returns its length."""
    elem = key.elem or key.vtype
    what = "an array of " + ("strings" if elem == T.STRING else "floats" if elem in _FLOATS else "integers")
    if elem == T.STRING:  # a StringArray (item_type str) holds nothing else; lists are looked at item by item
        ok = isinstance(v, (list, tuple)) or getattr(v, "item_type", None) is str
        ok = ok and (getattr(v, "item_type", None) is str or all(isinstance(s, (str, bytes)) for s in v))
        if not ok:
            raise ctx.fail(name, f"must be {what}, got {_kind(v)}")
    else:
        arr = _numeric(v)
        kinds = key.elem_kinds or ("fiu" if elem in _FLOATS else "iu")
        if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in kinds):
            raise ctx.fail(name, f"must be {what}{' (or a single value)' if key.per_layer else ''}, got {_kind(v)}")
        if arr.dtype.kind == "f" and arr.size:
            bad = np.isnan(arr) if key.allow_inf else ~np.isfinite(arr)
            if bad.any():
                raise ctx.fail(name, f"has a non-finite element at index {int(np.argmax(bad))}")
    n = len(v)
    length = "n_layers" if key.per_layer else key.length
    want = ctx.q.get(length) if length else None
    if want is not None and n != want:
        raise ctx.fail(name, f"has {n} elements, expected {want} ({QUANTITIES[length].format(arch=ctx.arch)})")
    if key.lo is not None and not key.per_layer and key.vtype == T.ARRAY and n < key.lo:
        raise ctx.fail(name, f"has {n} elements, expected at least {key.lo}")
    return n


def _numeric(v) -> np.ndarray | None:
    if isinstance(v, np.ndarray):
        return v
    if isinstance(v, (list, tuple)):
        if not all(isinstance(x, (int, float, np.integer, np.floating)) for x in v):
            return None
        return np.asarray(v) if v else np.zeros(0, np.int64)
    return None


def _in_range(key: Key, name: str, v, ctx: _Context, out: dict) -> bool:
    """Bounds and rules of a number (every element of a numeric array); False if the key was dropped."""
    if key.vtype in (T.STRING, T.BOOL, T.ARRAY):  # an ARRAY's bounds are on its length (checked with its type)
        return True
    arr = np.asarray(v) if not _is_scalar(v) else None
    lo, hi = ctx.resolve(key.lo), ctx.resolve(key.hi)
    vals = arr if arr is not None else np.asarray([v])
    bad = np.zeros(vals.shape, bool)
    if lo is not None:
        bad = bad | ((vals <= lo) if key.lo_open else (vals < lo))
    if hi is not None:  # a bound may be per layer where the value is one number: compare each pair
        bad = bad | (vals > np.asarray(hi))
        vals = np.broadcast_to(vals, bad.shape)
    if bad.any():
        x = vals[int(np.argmax(bad))].item()
        if key.on_range == "drop":
            log.warning("%s: metadata key %r = %s is out of range [%s, %s]; ignored", ctx.path, name, x, lo, hi)
            del out[name]
            return False
        interval = f"{'(' if key.lo_open else '['}{lo if lo is not None else '-inf'}, " \
                   f"{hi if hi is not None else 'inf'}]"
        bound = key.hi if isinstance(key.hi, str) else None
        why = f", {QUANTITIES.get(bound, ctx.key(bound or ''))}" if bound else ""
        raise ctx.fail(name, f"= {x} is out of range {interval}{why}")
    if key.rule:
        test, what = RULES[key.rule]
        if not all(test(int(x)) for x in vals.tolist()):
            raise ctx.fail(name, f"must be {what}, got {v}")
    return True


_BY_NAME = {k.name: k for k in KEYS}


# --- rules that relate keys -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Invariant:
    """A rule over several checked keys; ``check`` raises a one-line named error naming the key at fault."""

    scope: str
    check: Callable[[_Context, dict], None]
    doc: str


def _heads(ctx: _Context, m: dict) -> None:
    g = lambda k: m.get(ctx.key("{arch}." + k))  # noqa: E731
    if g("attention.head_count") is None or g("embedding_length") is None:
        return  # nothing to relate (a scope checked without its required keys)
    n_heads = np.asarray(g("attention.head_count"))
    n_kv = g("attention.head_count_kv")
    if n_kv is not None and np.any(n_heads % np.asarray(n_kv)):
        raise ctx.fail(ctx.key("{arch}.attention.head_count_kv"), f"= {n_kv} does not divide the head count "
                                                                  f"{n_heads.tolist()}")
    key_length = g("attention.key_length")
    head_dim = key_length if key_length is not None else g("embedding_length") // int(n_heads.max())
    at_fault = ctx.key("{arch}.attention." + ("key_length" if key_length is not None else "head_count"))
    if head_dim < 1 or head_dim % 2:
        raise ctx.fail(at_fault, f"gives a head size of {head_dim} (rotary embeddings need an even size >= 2)")
    rot = g("rope.dimension_count")
    if rot is not None and (rot > head_dim or rot % 2) and n_heads.min() == n_heads.max():  # (varying: loader)
        raise ctx.fail(ctx.key("{arch}.rope.dimension_count"), f"= {rot}: rotary dimensions must be even and at "
                                                              f"most the head size {head_dim}")


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>\Z")


def _byte_tokens(ctx: _Context, m: dict) -> None:
    types, tokens = m.get("tokenizer.ggml.token_type"), m.get("tokenizer.ggml.tokens")
    if types is None or tokens is None:
        return
    for i in np.flatnonzero(np.asarray(types) == 6).tolist():  # LLAMA_TOKEN_TYPE_BYTE
        text = tokens[i]
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        if not _BYTE_TOKEN.match(text):
            raise ctx.fail("tokenizer.ggml.token_type", f"marks token {i} ({text[:20]!r}) as a byte, "
                                                        "but its text is not <0xHH>")


INVARIANTS: tuple[Invariant, ...] = (
    Invariant("model", _heads, "KV heads divide the heads; the head size is even and >= 2; rope covers an even part of it"),
    Invariant("tokenizer", _byte_tokens, "every token typed BYTE is written <0xHH>"),
)
