"""The paged K/V arrays: per layer (n_blocks, block_size, n_kv_heads, head_dim) in NumPy."""
from __future__ import annotations

import numpy as np

from edgellm.engine.swa import WindowSlots
from edgellm.loader import ModelConfig


# compact types are kept as bit patterns: f16 in int16 (llama.cpp's default KV type), bf16 in uint16
KV_DTYPES = {"f32": np.float32, "f16": np.int16, "bf16": np.uint16}


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounding to nearest even (NaN stays NaN)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (b >> np.uint32(16)) | np.uint32(0x40), r).astype(np.uint16)


def to_f16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> IEEE half bit patterns (int16), round to nearest even."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.int16)


ENCODE = {"f16": to_f16_bits, "bf16": to_bf16_bits}


class PagedKVCache:
    """Block-paged K/V storage shared by all sequences; which block belongs to whom is the BlockPool's job.

    kv_dtype "f32" (default), "f16" or "bf16" (half the memory; the attention kernel widens them on the fly).
    swa_slots: if set (models with sliding-window layers), those layers keep K/V in swa_slots + 1 slots managed
    by a WindowSlots (engine/swa.py) instead of one entry per block."""

    def __init__(self, cfg: ModelConfig, n_blocks: int, block_size: int = 16, kv_dtype: str = "f32",
                 swa_slots: int | None = None):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}")
        dtype = KV_DTYPES[kv_dtype]
        self.kv_dtype = kv_dtype
        self.n_blocks, self.block_size = n_blocks, block_size
        trim = bool(swa_slots) and cfg.sliding_window > 0 and swa_slots < n_blocks
        self.windows = WindowSlots(n_blocks, swa_slots, block_size, cfg.sliding_window) if trim else None
        self.trimmed = tuple(trim and local for local in cfg.swa_layers)  # per layer: K/V indexed by slot
        rows = [swa_slots + 1 if t else n_blocks for t in self.trimmed]
        self.k = [np.zeros((n, block_size, cfg.n_kv_heads, cfg.head_dim), dtype=dtype) for n in rows]
        self.v = [np.zeros((n, block_size, cfg.n_kv_heads, cfg.v_head_dim), dtype=dtype) for n in rows]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def layer(self, i: int):
        """(K, V) arrays of layer i: (NB, BS, KVH, hd) each (NB = slots + 1 for a trimmed layer)."""
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
        for i in range(len(self.k)):
            s, d = slots if self.trimmed[i] else (src, dst)
            self.k[i][d, :n] = self.k[i][s, :n]
            self.v[i][d, :n] = self.v[i][s, :n]
        return True

    def write(self, i: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store k/v (T, KVH, hd) at flat slots (T,) = block * block_size + offset."""
        kf = self.k[i].reshape(-1, *self.k[i].shape[2:])
        vf = self.v[i].reshape(-1, *self.v[i].shape[2:])
        if self.kv_dtype != "f32":
            k, v = ENCODE[self.kv_dtype](k), ENCODE[self.kv_dtype](v)
        kf[slots] = k
        vf[slots] = v

    # -- block contents for the prompt cache on disk (engine/prompt_cache.py) ----------------------------------
    def block_stores(self) -> list[tuple[np.ndarray, bool]]:
        """Every per-layer storage array, indexed by block (or, if the flag is set, by sliding-window slot) on
        axis 0: the unit export_block / import_block work over."""
        return [(a, t) for arrays in (self.k, self.v) for a, t in zip(arrays, self.trimmed)]

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
