"""The paged K/V arrays: per layer (n_blocks, block_size, n_kv_heads, head_dim) in NumPy, in one of KV_DTYPES."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from edgellm.engine.swa import WindowSlots
from edgellm.errors import InvalidRequestError, UnsupportedModelError
from edgellm.loader import ModelConfig
from kernels_cpu.attention_q8 import QK8_0, Q8Cache, quantize_q8_0


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounding to nearest even (NaN stays NaN)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (b >> np.uint32(16)) | np.uint32(0x40), r).astype(np.uint16)


def to_f16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> IEEE half bit patterns (int16), round to nearest even."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.int16)


@dataclass(frozen=True)
class KVCodec:
    """How one of K or V is stored: its arrays per (token, KV head) row of hd values, and how float32 rows
    become their contents. Every array of a layer keeps the leading axes (block or slot, row in block, KV head)."""

    parts: Callable[[int], tuple]  # hd -> ((row width, dtype), ...): one storage array each
    encode: Callable[[np.ndarray], tuple]  # (T, KVH, hd) float32 -> one (T, KVH, width) array per part
    view: Callable[[tuple], object] = lambda arrays: arrays[0]  # the arrays as paged_attention takes them
    block: int = 1  # hd must be a multiple of this


def _plain(dtype, encode=lambda x: x):
    return KVCodec(parts=lambda hd: ((hd, dtype),), encode=lambda x: (encode(x),))


# compact types are kept as bit patterns: f16 in int16 (llama.cpp's default KV type), bf16 in uint16; q8_0 as
# ggml's blocks (kernels_cpu/attention_q8.py). The attention kernels read every form in place.
KV_DTYPES = {
    "f32": _plain(np.float32),
    "f16": _plain(np.int16, to_f16_bits),
    "bf16": _plain(np.uint16, to_bf16_bits),
    "q8_0": KVCodec(parts=lambda hd: ((hd, np.int8), (hd // QK8_0, np.int16)), encode=quantize_q8_0,
                    view=lambda arrays: Q8Cache(*arrays), block=QK8_0),
}


def check_kv_dtype(kv_dtype: str, cfg: ModelConfig | None = None) -> KVCodec:
    """The codec of kv_dtype; InvalidRequestError for an unknown name, UnsupportedModelError if the model's
    head sizes do not split into the type's blocks (q8_0: 32, as in ggml)."""
    codec = KV_DTYPES.get(kv_dtype)
    if codec is None:
        raise InvalidRequestError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r}")
    if cfg is not None and (cfg.head_dim % codec.block or cfg.v_head_dim % codec.block):
        raise UnsupportedModelError(f"kv_dtype {kv_dtype} needs head sizes that are multiples of {codec.block}; "
                                    f"this model's K/V heads have {cfg.head_dim}/{cfg.v_head_dim} values "
                                    f"(use kv_dtype f16)")
    return codec


class PagedKVCache:
    """Block-paged K/V storage shared by all sequences; which block belongs to whom is the BlockPool's job.

    kv_dtype: a name of KV_DTYPES: "f32" (default), "f16" or "bf16" (half the memory), "q8_0" (0.53x f16's).
    swa_slots: if set (models with sliding-window layers), those layers keep K/V in swa_slots + 1 slots managed
    by a WindowSlots (engine/swa.py) instead of one entry per block."""

    def __init__(self, cfg: ModelConfig, n_blocks: int, block_size: int = 16, kv_dtype: str = "f32",
                 swa_slots: int | None = None):
        self.codec = codec = check_kv_dtype(kv_dtype, cfg)
        self.kv_dtype = kv_dtype
        self.n_blocks, self.block_size = n_blocks, block_size
        trim = bool(swa_slots) and cfg.sliding_window > 0 and swa_slots < n_blocks
        self.windows = WindowSlots(n_blocks, swa_slots, block_size, cfg.sliding_window) if trim else None
        self.trimmed = tuple(trim and local for local in cfg.swa_layers)  # per layer: K/V indexed by slot
        rows = [swa_slots + 1 if t else n_blocks for t in self.trimmed]

        def arrays(n, hd):  # one array per codec part: (n, BS, KVH, width)
            return tuple(np.zeros((n, block_size, cfg.n_kv_heads, w), dtype) for w, dtype in codec.parts(hd))

        self._k = [arrays(n, cfg.head_dim) for n in rows]
        self._v = [arrays(n, cfg.v_head_dim) for n in rows]
        self.k = [codec.view(a) for a in self._k]  # per layer: K as paged_attention takes it
        self.v = [codec.view(a) for a in self._v]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for i in range(len(self._k)) for a in self.storage(i))

    def storage(self, i: int) -> tuple[np.ndarray, ...]:
        """Every array of layer i (K's parts, then V's), each indexed by block (slot for a trimmed layer) on axis
        0 and by row in the block on axis 1: what copying or saving a block must take."""
        return self._k[i] + self._v[i]

    def layer(self, i: int):
        """(K, V) of layer i as paged_attention takes them: (NB, BS, KVH, hd) arrays, or Q8Cache for q8_0 (NB =
        slots + 1 for a trimmed layer)."""
        return self.k[i], self.v[i]

    def tables(self, i: int, batch) -> np.ndarray:
        """Block tables of the batch as layer i indexes its K/V: block ids, or for a trimmed layer the slot
        tables the KV cache manager set before the forward (KVCacheManager.prepare)."""
        if not self.trimmed[i]:
            return batch.block_tables
        if batch.slot_tables is None:
            raise RuntimeError("a trimmed sliding-window layer needs KVCacheManager.prepare(batch) first")
        return batch.slot_tables

    def copy_block(self, src: int, dst: int, n: int, keep=frozenset()) -> bool:
        """Copy rows [0, n) of block src's K/V into block dst in every layer (copy-on-write of a shared block).
        Trimmed layers copy between slots; False (nothing copied) if they no longer hold src or have no slot for
        dst that is not one of the blocks in `keep`."""
        slots = None
        if self.windows is not None and any(self.trimmed):
            slots = self.windows.prepare_copy(src, dst, keep)
            if slots is None:
                return False
        for i in range(len(self._k)):
            s, d = slots if self.trimmed[i] else (src, dst)
            for a in self.storage(i):
                a[d, :n] = a[s, :n]
        return True

    def write(self, i: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store k/v (T, KVH, hd) at flat slots (T,) = block * block_size + offset."""
        parts = self.codec.encode(k) + self.codec.encode(v)
        if len(slots) == 1:  # a decode row: basic indexing (a fancy-indexed store costs several times more)
            b, r = divmod(int(slots[0]), self.block_size)
            for a, p in zip(self.storage(i), parts):
                a[b, r] = p[0]
            return
        for a, p in zip(self.storage(i), parts):
            a.reshape(-1, *a.shape[2:])[slots] = p

    # -- block contents for the prompt cache on disk (engine/prompt_cache.py) ----------------------------------
    def block_stores(self) -> list[tuple[np.ndarray, bool]]:
        """Every per-layer storage array, indexed by block (or, if the flag is set, by sliding-window slot) on
        axis 0: the unit export_block / import_block work over."""
        return [(a, t) for i, t in enumerate(self.trimmed) for a in self.storage(i)]

    def export_block(self, b: int) -> list[np.ndarray | None]:
        """Copies of block b's rows in every store (block_stores order): (BS, ...) each; None for a slot-indexed
        store when b's sliding-window K/V is no longer in a slot."""
        held = self.windows is not None and self.windows.holds(b)
        return [a[b].copy() if not t else a[self.windows.slot[b]].copy() if held else None
                for a, t in self.block_stores()]

    def import_block(self, b: int, arrays) -> None:
        """Write rows exported by export_block into block b. A slot-indexed store is written only when b holds a
        slot (the KV cache manager gives it one first) and its entry is not None."""
        held = self.windows is not None and self.windows.holds(b)
        for (a, t), x in zip(self.block_stores(), arrays):
            if not t:
                a[b] = x
            elif held and x is not None:
                a[self.windows.slot[b]] = x
