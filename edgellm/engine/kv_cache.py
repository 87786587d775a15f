"""The paged K/V arrays: per layer (n_blocks, block_size, n_kv_heads, head_dim) in NumPy."""
from __future__ import annotations

import numpy as np

from edgellm.loader import ModelConfig


class PagedKVCache:
    """Block-paged K/V storage shared by all sequences; which block belongs to whom is the BlockPool's job."""

    def __init__(self, cfg: ModelConfig, n_blocks: int, block_size: int = 16, dtype=np.float32):
        self.n_blocks, self.block_size = n_blocks, block_size
        shape_k = (n_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        shape_v = (n_blocks, block_size, cfg.n_kv_heads, cfg.v_head_dim)
        self.k = [np.zeros(shape_k, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [np.zeros(shape_v, dtype=dtype) for _ in range(cfg.n_layers)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def layer(self, i: int):
        """(K, V) arrays of layer i: (NB, BS, KVH, hd) each."""
        return self.k[i], self.v[i]

    def write(self, i: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store k/v (T, KVH, hd) at flat slots (T,) = block * block_size + offset."""
        kf = self.k[i].reshape(-1, *self.k[i].shape[2:])
        vf = self.v[i].reshape(-1, *self.v[i].shape[2:])
        kf[slots] = k
        vf[slots] = v

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write support: duplicate one block's K/V in every layer."""
        for a in self.k + self.v:
            a[dst] = a[src]
