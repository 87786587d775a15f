"""Seeded mutation fuzzer of GGUF files: the shared engine of tests/test_fuzz_gguf.py and benchmarks/fuzz_gguf.py.

A base file is taken apart once with `gguf.GGUFReader` into its header, metadata entries, tensor-table entries and
data; each mutation then corrupts it in one way a damaged or hostile file could be corrupt: bit flips in the
metadata or the tensor table, a value re-encoded as another GGUF type, an array of the wrong length, a huge count,
an edge value (0, -1, NaN, out of range), a dropped or repeated key, a broken tensor entry, a truncated file.
Case `i` of seed `s` is always the same mutation (`describe` names it), so a failure is reproduced by its numbers.

`exercise` is what a user's first command does with a file: load it, build the tokenizer, render the chat
template, detokenize the vocabulary, build the model and run a one-token forward. Its outcome is "ok" or the name
of the `EdgeLLMError` subclass raised; any other exception escapes (that is what the fuzzer looks for).
"""
from __future__ import annotations

import random
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFReader, GGUFValueType

from edgellm.gguf_file import VALUE_DTYPES

T = GGUFValueType
INT_TYPES = (T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64)
ALL_TYPES = tuple(T)
HUGE = (2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
SLOW_SECONDS = 2.0  # a case slower than this is reported (a corrupt count must not make us loop)
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass(frozen=True)
class Entry:
    """One metadata entry or tensor-table entry: its bytes and where its parts sit inside them."""

    name: str
    raw: bytes
    type_at: int  # metadata: the value-type u32; tensors: the ggml-type u32
    count_at: int | None = None  # arrays: the element count u64; tensors: the n_dims u32
    vtype: int | None = None
    etype: int | None = None
    value: object = None  # metadata: the decoded value (gguf's `contents()`)


@dataclass
class BaseFile:
    """A GGUF file taken apart: header fields, metadata entries, tensor entries and the data section."""

    version: int
    kv: list[Entry]
    tensors: list[Entry]
    data: bytes  # everything from the aligned data start on
    alignment: int = GGUF_DEFAULT_ALIGNMENT
    image: bytes = field(default=b"", repr=False)  # the original file, rebuilt

    @classmethod
    def read(cls, path: str | Path, extra: dict[str, tuple[int, object]] | None = None) -> "BaseFile":
        """Parse `path`; `extra` adds metadata entries {key: (GGUF value type, value)} (e.g. a chat template)."""
        blob = Path(path).read_bytes()
        r = GGUFReader(str(path))
        kv = []
        for key, f in r.fields.items():
            if key.startswith("GGUF."):
                continue
            sizes = [p.nbytes for p in f.parts]
            end = f.offset + sum(sizes)
            type_at = sizes[0] + sizes[1]
            vtype = int(f.types[0])
            etype = int(f.types[1]) if vtype == T.ARRAY and len(f.types) > 1 else None
            kv.append(Entry(key, blob[f.offset:end], type_at, type_at + 8 if vtype == T.ARRAY else None,
                            vtype, etype, f.contents()))
        tensors = []
        for t in r.tensors:
            sizes = [p.nbytes for p in t.field.parts]
            end = t.field.offset + sum(sizes)
            n_dims_at = sizes[0] + sizes[1]
            tensors.append(Entry(t.name, blob[t.field.offset:end], n_dims_at + 4 + sizes[3], n_dims_at))
        data_start = r.data_offset if r.tensors else len(blob)
        base = cls(int(r.fields["GGUF.version"].contents()), kv, tensors, blob[data_start:], r.alignment)
        for key, (vtype, value) in (extra or {}).items():
            base.kv.append(make_entry(key, vtype, value))
        base.image = base.build()
        return base

    def build(self, kv: list[Entry] | None = None, tensors: list[Entry] | None = None, *,
              n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
        """File bytes from (possibly changed) entries; counts default to the true ones."""
        kv = self.kv if kv is None else kv
        tensors = self.tensors if tensors is None else tensors
        head = b"GGUF" + struct.pack("<IQQ", self.version, len(tensors) if n_tensors is None else n_tensors,
                                     len(kv) if n_kv is None else n_kv)
        body = head + b"".join(e.raw for e in kv) + b"".join(e.raw for e in tensors)
        if not self.tensors:
            return body
        return body + b"\0" * (-len(body) % self.alignment) + self.data

    def with_value(self, key: str, vtype: int, value, etype: int | None = None) -> bytes:
        """File bytes with `key` set to `value` of type `vtype` (replaced in place, or added at the end)."""
        entry = make_entry(key, vtype, value, etype)
        kv = [entry if e.name == key else e for e in self.kv]
        return self.build(kv if any(e.name == key for e in self.kv) else kv + [entry])

    def without(self, key: str) -> bytes:
        """File bytes with `key` removed."""
        return self.build([e for e in self.kv if e.name != key])

    def regions(self) -> tuple[int, int]:
        """(end of metadata, end of tensor table) in `image`."""
        kv_end = 24 + sum(len(e.raw) for e in self.kv)
        return kv_end, kv_end + sum(len(e.raw) for e in self.tensors)


def encode_value(vtype: int, value, etype: int | None = None) -> bytes:
    """GGUF encoding of one value (arrays: `value` is a sequence of `etype` values)."""
    if vtype == T.STRING:
        b = value if isinstance(value, bytes) else str(value).encode("utf-8", "surrogatepass")
        return struct.pack("<Q", len(b)) + b
    if vtype == T.ARRAY:
        head = struct.pack("<IQ", etype, len(value))
        if etype in VALUE_DTYPES:
            return head + np.asarray(value).astype(VALUE_DTYPES[etype]).tobytes()
        return head + b"".join(encode_value(etype, v, T.UINT8) for v in value)
    return np.asarray(value).astype(VALUE_DTYPES[vtype]).tobytes()


def make_entry(key: str, vtype: int, value, etype: int | None = None) -> Entry:
    """A metadata entry for `key` holding `value` as `vtype` (arrays: of `etype`)."""
    kb = key.encode()
    raw = struct.pack("<Q", len(kb)) + kb + struct.pack("<I", vtype) + encode_value(vtype, value, etype)
    type_at = 8 + len(kb)
    return Entry(key, raw, type_at, type_at + 8 if vtype == T.ARRAY else None, vtype, etype, value)


# --- mutations: each takes (rng, base) and returns (file bytes, description) ------------------------------------

def _flip(rng: random.Random, buf: bytes, lo: int, hi: int) -> tuple[bytes, str]:
    b = bytearray(buf)
    flips = []
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        pos, bit = rng.randrange(lo, hi), rng.randrange(8)
        b[pos] ^= 1 << bit
        flips.append(f"{pos}.{bit}")
    return bytes(b), "flip " + ",".join(flips)


def flip_metadata(rng, base):
    kv_end, _ = base.regions()
    return _flip(rng, base.image, 24, kv_end)


def flip_tensor_table(rng, base):
    kv_end, table_end = base.regions()
    return _flip(rng, base.image, kv_end, table_end) if table_end > kv_end else flip_metadata(rng, base)


def flip_header(rng, base):
    return _flip(rng, base.image, 4, 24)


def set_byte(rng, base):
    _, table_end = base.regions()
    b = bytearray(base.image)
    pos = rng.randrange(4, table_end)
    b[pos] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
    return bytes(b), f"byte {pos}={b[pos]:#x}"


def _pick(rng, base) -> tuple[int, Entry]:
    i = rng.randrange(len(base.kv))
    return i, base.kv[i]


def _replace(base, i: int, entry: Entry | None) -> list[Entry]:
    kv = list(base.kv)
    if entry is None:
        del kv[i]
    else:
        kv[i] = entry
    return kv


def _random_value(rng, vtype: int, like=None):
    """A value of GGUF type `vtype`, sometimes shaped after `like` (same length for arrays)."""
    if vtype == T.STRING:
        return rng.choice(("", "x", "llama", "gpt2", "\xff" * 3, "a" * 300, str(like)[:20]))
    if vtype == T.BOOL:
        return rng.random() < 0.5
    if vtype in (T.FLOAT32, T.FLOAT64):
        return rng.choice((0.0, -1.0, 1e-6, 1.0, 1e30, float("nan"), float("inf"), -float("inf")))
    if vtype == T.ARRAY:
        etype = rng.choice((T.INT32, T.UINT32, T.FLOAT32, T.STRING, T.UINT8, T.BOOL, T.INT64))
        n = len(like) if isinstance(like, (list, tuple)) and rng.random() < 0.5 else rng.choice((0, 1, 2, 5))
        return etype, [_random_value(rng, etype) for _ in range(n)]
    info = np.iinfo(VALUE_DTYPES[vtype])
    return rng.choice((0, 1, 2, info.max, info.min, rng.randrange(int(info.min), int(info.max) + 1)))


def retype(rng, base):
    """Re-encode one entry as a value of another GGUF type (a scalar where an array belongs, and so on)."""
    i, e = _pick(rng, base)
    vtype = rng.choice([t for t in ALL_TYPES if t != e.vtype] + [T.ARRAY] * 2)
    value = _random_value(rng, vtype, e.value)
    etype = None
    if vtype == T.ARRAY:
        etype, value = value
        if e.vtype == T.ARRAY and etype == e.etype:  # same element type is no retyping: pick another
            etype = T.FLOAT32 if etype != T.FLOAT32 else T.INT32
            value = [_random_value(rng, etype) for _ in value]
    if e.vtype != T.ARRAY and vtype != T.ARRAY and rng.random() < 0.3 and vtype in VALUE_DTYPES and \
            isinstance(e.value, (int, float)) and not isinstance(e.value, bool):
        value = e.value  # same number, other type (a float written as int, an int as float ...)
    entry = make_entry(e.name, vtype, value, etype)
    return base.build(_replace(base, i, entry)), f"retype {e.name} -> {T(vtype).name}" + \
        (f"[{T(etype).name} x{len(value)}]" if etype is not None else f"={value!r:.40}")


def wrong_length(rng, base):
    """An array of the right element type but the wrong number of elements."""
    arrays = [(i, e) for i, e in enumerate(base.kv) if e.vtype == T.ARRAY and e.etype != T.ARRAY]
    i, e = rng.choice(arrays)
    items = list(e.value)
    n = rng.choice((0, 1, len(items) - 1, len(items) + 1, len(items) // 2, len(items) * 2))
    items = (items * (n // max(len(items), 1) + 1))[:n] if items else [0] * n
    return base.build(_replace(base, i, make_entry(e.name, T.ARRAY, items, e.etype))), \
        f"length {e.name} {len(e.value)} -> {n}"


def value_type_id(rng, base):
    """Overwrite one entry's value-type (or element-type) u32 without re-encoding the value."""
    i, e = _pick(rng, base)
    raw = bytearray(e.raw)
    at = e.type_at + (4 if e.vtype == T.ARRAY and rng.random() < 0.5 else 0)
    new = rng.choice(list(range(14)) + [255, 2**31, 2**32 - 1])
    struct.pack_into("<I", raw, at, new)
    return base.build(_replace(base, i, Entry(e.name, bytes(raw), e.type_at))), f"type id {e.name}@{at} -> {new}"


def huge_count(rng, base):
    """A count the file cannot hold: header counts, an array count, a string length, a tensor's dims."""
    value = rng.choice(HUGE + (rng.randrange(2**16, 2**32),))
    where = rng.choice(("n_kv", "n_tensors", "array", "array", "string", "key", "n_dims", "dim"))
    if where == "n_kv":
        return base.build(n_kv=value), f"n_kv={value}"
    if where == "n_tensors" and base.tensors:
        return base.build(n_tensors=value), f"n_tensors={value}"
    if where in ("array", "string"):
        pool = [(i, e) for i, e in enumerate(base.kv) if e.vtype == (T.ARRAY if where == "array" else T.STRING)]
        i, e = rng.choice(pool)
        raw = bytearray(e.raw)
        struct.pack_into("<Q", raw, e.count_at if where == "array" else e.type_at + 4, value)
        return base.build(_replace(base, i, Entry(e.name, bytes(raw), e.type_at))), f"count {e.name}={value}"
    if where in ("n_dims", "dim") and base.tensors:
        j = rng.randrange(len(base.tensors))
        t = base.tensors[j]
        raw = bytearray(t.raw)
        if where == "n_dims":
            struct.pack_into("<I", raw, t.count_at, value & 0xFFFFFFFF)
        else:
            (n_dims,) = struct.unpack_from("<I", raw, t.count_at)
            struct.pack_into("<Q", raw, t.count_at + 4 + 8 * rng.randrange(n_dims), value)
        tensors = list(base.tensors)
        tensors[j] = Entry(t.name, bytes(raw), t.type_at, t.count_at)
        return base.build(tensors=tensors), f"{where} {t.name}={value}"
    i, e = _pick(rng, base)  # the key's own length
    raw = bytearray(e.raw)
    struct.pack_into("<Q", raw, 0, value)
    return base.build(_replace(base, i, Entry(e.name, bytes(raw), e.type_at))), f"key length {e.name}={value}"


def huge_count_of(base: BaseFile, key: str, count: int) -> bytes:
    """File bytes whose array or string `key` claims `count` elements (bytes)."""
    i, e = next((i, e) for i, e in enumerate(base.kv) if e.name == key)
    raw = bytearray(e.raw)
    struct.pack_into("<Q", raw, e.count_at if e.vtype == T.ARRAY else e.type_at + 4, count)
    return base.build(_replace(base, i, Entry(e.name, bytes(raw), e.type_at)))


def edge_value(rng, base):
    """Same type, edge value: 0, -1 (as unsigned: max), NaN, inf, vocab size, huge; arrays: one bad element."""
    i, e = _pick(rng, base)
    vtype, etype, value = e.vtype, e.etype, e.value
    if vtype == T.ARRAY and etype in VALUE_DTYPES and len(value):
        items = list(value)
        items[rng.randrange(len(items))] = _random_value(rng, etype)
        value = items
    elif vtype == T.ARRAY and etype == T.STRING and len(value):
        items = list(value)
        items[rng.randrange(len(items))] = rng.choice(("", " ", "<0xZZ>", "<0x", items[0], "\u2581" * 40))
        value = items
    elif vtype in VALUE_DTYPES:
        value = _random_value(rng, vtype)
        if vtype in INT_TYPES and rng.random() < 0.3:
            n = len(next((k.value for k in base.kv if k.name == "tokenizer.ggml.tokens"), ()))
            value = rng.choice((n, n - 1, n + 1))
    elif vtype == T.STRING:
        value = _random_value(rng, vtype, value)
    return base.build(_replace(base, i, make_entry(e.name, vtype, value, etype))), f"value {e.name}={value!r:.60}"


def drop_or_repeat(rng, base):
    """A required key gone, or one key twice (the second with another value)."""
    i, e = _pick(rng, base)
    if rng.random() < 0.5:
        return base.build(_replace(base, i, None)), f"drop {e.name}"
    kv = list(base.kv)
    kv.insert(rng.randrange(len(kv) + 1), e)
    return base.build(kv), f"repeat {e.name}"


def tensor_entry(rng, base):
    """One tensor entry's type, a dim, or its offset set to a wrong value; or two entries swapped/repeated."""
    if not base.tensors:
        return flip_metadata(rng, base)
    j = rng.randrange(len(base.tensors))
    t = base.tensors[j]
    raw = bytearray(t.raw)
    (n_dims,) = struct.unpack_from("<I", raw, t.count_at)
    what = rng.choice(("type", "dim", "offset", "ndims", "repeat", "drop"))
    tensors = list(base.tensors)
    if what == "type":
        struct.pack_into("<I", raw, t.type_at, rng.choice(list(range(40)) + [2**31]))
    elif what == "dim":
        struct.pack_into("<Q", raw, t.count_at + 4 + 8 * rng.randrange(n_dims), rng.choice((0, 1, 2, 31, 33, 10**6)))
    elif what == "offset":
        (off,) = struct.unpack_from("<Q", raw, t.type_at + 4)
        struct.pack_into("<Q", raw, t.type_at + 4, rng.choice((0, 1, off + 1, off + 32, len(base.data), 2**63)))
    elif what == "ndims":
        struct.pack_into("<I", raw, t.count_at, rng.choice((0, 1, 2, 3, 5)))
    elif what == "repeat":
        tensors.insert(rng.randrange(len(tensors) + 1), t)
        return base.build(tensors=tensors), f"tensor repeat {t.name}"
    else:
        del tensors[j]
        return base.build(tensors=tensors), f"tensor drop {t.name}"
    tensors[j] = Entry(t.name, bytes(raw), t.type_at, t.count_at)
    return base.build(tensors=tensors), f"tensor {what} {t.name}"


def truncate(rng, base):
    _, table_end = base.regions()
    n = rng.choice((rng.randrange(0, table_end + 1), rng.randrange(0, len(base.image))))
    return base.image[:n], f"truncate {n}/{len(base.image)}"


MUTATIONS = (  # (weight, mutation)
    (24, flip_metadata), (10, flip_tensor_table), (3, flip_header), (5, set_byte), (12, retype), (8, wrong_length),
    (5, value_type_id), (8, huge_count), (12, edge_value), (4, drop_or_repeat), (6, tensor_entry), (3, truncate),
)
_WEIGHTS = [w for w, _ in MUTATIONS]


def mutate(base: BaseFile, seed: int, case: int) -> tuple[bytes, str]:
    """The mutated bytes of case `case` under `seed`, and what was done."""
    rng = random.Random(seed * 1_000_003 + case)
    (fn,) = rng.choices([m for _, m in MUTATIONS], weights=_WEIGHTS)
    data, what = fn(rng, base)
    return data, f"{fn.__name__}: {what}"


# --- the files fuzzed ----------------------------------------------------------------------------------------

TINY = dict(n_vocab=264, d_model=32, d_ff=64, n_head=2, n_kv_head=1, head_dim=16, n_layer=1, context_length=64)
GOLDEN_BPE = Path(__file__).parent / "golden" / "tokenizer_bpe_tiny.gguf"


@dataclass(frozen=True)
class Target:
    """One base file of a fuzz run: `model` False for a vocabulary-only file (tokenizer and template only)."""

    name: str
    base: BaseFile
    model: bool = True


def targets(directory: str | Path) -> list[Target]:
    """The bases: a tiny llama (untied output, rope.dimension_count, a ChatML template), a tiny gemma3 (sliding
    window, key/value lengths, tied output, two layers) and the byte-level BPE vocabulary of the tokenizer tests."""
    from tiny_models import write_tiny_model

    directory = Path(directory)
    llama = write_tiny_model(directory / "fuzz_llama.gguf", "llama", **TINY)
    gemma = write_tiny_model(directory / "fuzz_gemma3.gguf", "gemma3", **{**TINY, "n_layer": 2}, sliding_window=8)
    return [Target("llama", BaseFile.read(llama, {"tokenizer.chat_template": (T.STRING, CHATML)})),
            Target("gemma3", BaseFile.read(gemma)),
            Target("bpe-vocab", BaseFile.read(GOLDEN_BPE), model=False)]


def base_types(target: Target, directory: str | Path) -> frozenset:
    """The tensor types of a target's unmutated file (those whose kernels a run compiles before mutating)."""
    from edgellm.gguf_file import read_gguf

    path = Path(directory) / f"types_{target.name}.gguf"
    path.write_bytes(target.base.image)
    return frozenset(t.qtype for t in read_gguf(path).tensors.values())


# --- what a user's first command does with the file ---------------------------------------------------------------

def exercise(path: str, *, model: bool = True, forward_types: frozenset | None = None) -> str:
    """Load, tokenize, render the chat template, detokenize, build the model, forward one token.

    Returns "ok" or the name of the EdgeLLMError subclass raised; any other exception propagates.
    With model=False (vocabulary-only files) only the tokenizer and the template are exercised. With
    `forward_types`, a file with a tensor of another type is loaded but not run ("ok, not run"): running it
    would compile that type's kernels, seconds each, which a short in-suite run cannot afford.
    """
    from edgellm.chat_template import ChatTemplate
    from edgellm.errors import EdgeLLMError
    from edgellm.tokenizer import Tokenizer

    try:
        if model:
            from edgellm.loader import load_gguf

            lm = load_gguf(path)
            meta = lm.metadata
        else:
            lm, meta = None, None
        tok = Tokenizer.from_metadata(meta) if meta is not None else Tokenizer.from_gguf(path)
        name = lambda i: tok.tokens[i] if i is not None else ""  # noqa: E731
        template = ChatTemplate.from_metadata(meta if meta is not None else _metadata(path),
                                              bos_token=name(tok.bos_id), eos_token=name(tok.eos_id))
        text = template.render([{"role": "user", "content": "Hi there, 12 cats!"}])
        ids = tok.encode(text)
        tok.decode(ids)
        tok.decode(range(tok.vocab_size))
        if lm is not None:
            if forward_types is not None and {t.qtype for t in lm.gguf.tensors.values()} - forward_types:
                return "ok, not run"
            _forward_one(lm, ids[0] if ids else 0)
    except EdgeLLMError as e:
        return type(e).__name__
    return "ok"


def _metadata(path: str) -> dict:
    from edgellm.gguf_file import read_gguf

    return read_gguf(path).metadata


def _forward_one(lm, token: int) -> None:
    from edgellm.engine.kv_cache import PagedKVCache
    from edgellm.models.common import ForwardBatch

    model = lm.model_module().Model(lm)
    kv = PagedKVCache(lm.config, 1, 16)
    logits = model.forward(ForwardBatch.single([token], 0, [0]), kv)  # (1, n_vocab)
    assert logits.shape == (1, lm.config.n_vocab)


@dataclass
class Report:
    """Outcome counts of a run (in total and per target); `failures` lists the unacceptable outcomes as
    (target, seed, case, mutation, exception) and `slow` the cases slower than SLOW_SECONDS."""

    counts: dict[str, int] = field(default_factory=dict)
    per_target: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[tuple[str, int, int, str, str]] = field(default_factory=list)
    slow: list[tuple[str, int, int, str, float]] = field(default_factory=list)

    def add(self, target: str, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        mine = self.per_target.setdefault(target, {})
        mine[outcome] = mine.get(outcome, 0) + 1


def run(target: Target, path: str | Path, *, seed: int, cases: range, forward_types: frozenset | None = None,
        report: Report | None = None) -> Report:
    """Mutate the target's file for each case, write it to `path`, exercise it (see `exercise`), count outcomes."""
    import traceback

    report = report or Report()
    path = Path(path)
    for case in cases:
        data, what = mutate(target.base, seed, case)
        path.write_bytes(data)
        t0 = time.perf_counter()
        try:
            outcome = exercise(str(path), model=target.model, forward_types=forward_types)
        except MemoryError:  # no traceback walk: its frames still hold the memory
            outcome = "CRASH MemoryError"
            report.failures.append((target.name, seed, case, what, "MemoryError"))
        except Exception as e:  # the fuzzer's finding: anything that is not a named error
            outcome = f"CRASH {type(e).__name__}"
            tb = traceback.extract_tb(e.__traceback__)[-1]
            report.failures.append((target.name, seed, case, what, f"{type(e).__name__}: {str(e)[:120]} "
                                                                   f"at {Path(tb.filename).name}:{tb.lineno}"))
        report.add(target.name, outcome)
        seconds = time.perf_counter() - t0
        if seconds > SLOW_SECONDS:
            report.slow.append((target.name, seed, case, what, seconds))
    return report
