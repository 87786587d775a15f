"""What every architecture shares: the forward-batch contract, weight preparation, paged attention step."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgellm.loader import LoadedModel
from kernels_cpu import matmul, matmul_many
from kernels_cpu.ops import softcap
from kernels_cpu.attention import AttentionPlan, attention_plan, paged_attention
from quant.formats import dequantize


@dataclass
class ForwardBatch:
    """Tokens of one engine step, from one or more sequences (each sequence's rows contiguous).

    tokens, positions, row_seq: (T,) — token id, its position in its sequence, the sequence's index;
    block_tables: (S, MB) int32 — per sequence, the KV block holding positions [i*BS, (i+1)*BS);
    logit_rows: (R,) — rows whose logits are wanted (usually the last row of each sequence);
    slot_tables: (S, MB) — block_tables as trimmed sliding-window layers index their K/V (set before the forward
    by KVCacheManager.prepare, also for one-off forwards: LLM.scratch).
    """

    tokens: np.ndarray
    positions: np.ndarray
    row_seq: np.ndarray
    block_tables: np.ndarray
    logit_rows: np.ndarray
    slot_tables: np.ndarray | None = None
    _slots: dict = field(default_factory=dict, repr=False, compare=False)  # id(tables) -> (tables, slots)
    _plans: dict = field(default_factory=dict, repr=False, compare=False)  # (id(tables), shapes) -> (tables, plan)

    def slots(self, tables: np.ndarray, block_size: int) -> np.ndarray:
        """(T,) flat KV slots (block * block_size + offset) of the rows in `tables` (block_tables or
        slot_tables): computed once per forward, not once per layer."""
        hit = self._slots.get(id(tables))
        if hit is None or hit[0] is not tables:
            s = tables[self.row_seq, self.positions // block_size] * block_size + self.positions % block_size
            hit = self._slots[id(tables)] = (tables, s)
        return hit[1]

    def attention_plan(self, tables: np.ndarray, kshape: tuple, n_heads: int, vd: int) -> AttentionPlan:
        """The rows' attention plan (kernels_cpu.attention.attention_plan) over `tables` for a cache of shape
        kshape: validated and split once per forward, not once per layer."""
        key = (id(tables), tuple(kshape), n_heads, vd)
        hit = self._plans.get(key)
        if hit is None or hit[0] is not tables:
            hit = self._plans[key] = (tables, attention_plan(self.positions, self.row_seq, tables, kshape,
                                                             n_heads, vd))
        return hit[1]

    @classmethod
    def single(cls, tokens, start: int, block_table, *, all_logits: bool = False) -> "ForwardBatch":
        """One sequence: tokens at positions start.. ; logits for the last row (or every row)."""
        t = np.asarray(tokens, dtype=np.int64)
        n = len(t)
        rows = np.arange(n) if all_logits else np.array([n - 1])
        return cls(t, np.arange(start, start + n, dtype=np.int64), np.zeros(n, dtype=np.int64),
                   np.asarray(block_table, dtype=np.int64)[None, :], rows)


class Weights:
    """Tensors by name: matrices prepared for the quantized kernels, vectors as float32 (tiny)."""

    def __init__(self, loaded: LoadedModel, *, progress: bool = False):
        from edgellm.loader import expected_shapes
        from edgellm.weight_cache import prepare_all

        self._g = g = loaded.gguf
        names = []
        for n, shape in expected_shapes(loaded.config).items():
            if len(shape) == 3:  # experts: one stack per tensor, only the routed experts are read per token
                names.append(n)
            elif len(shape) == 2 and n.endswith(".weight") and (n != "token_embd.weight" or loaded.config.tied_output):
                # (2-D biases of experts are vectors per expert; an untied token_embd is a lookup only)
                names.append(n)
        names += [n for n in ("output.weight",) if n in g.tensors and n not in names]
        self._matrices = prepare_all(g, names, progress=progress)

    def matrix(self, name: str):
        """The prepared (repacked, memory-mapped when cached) weight of a 2-D tensor."""
        return self._matrices[name]

    def expert_stack(self, name: str):
        """The prepared experts of a 3-D (n_expert, N, K) tensor (kernels_cpu.moe_matmul.ExpertStack)."""
        return self._matrices[name]

    def vector(self, name: str) -> np.ndarray:
        t = self._g.tensors[name]
        return dequantize(self._g.read_tensor_copy(name), t.qtype).reshape(t.shape).astype(np.float32)

    def has(self, name: str) -> bool:
        return name in self._g.tensors


def attend(kv, layer: int, q, k, v, batch: ForwardBatch, *, window: int, scale: float, softcap: float,
           sinks: np.ndarray | None = None):
    """Write this step's K/V (T, KVH, hd) into the paged cache, then attend (sinks: (H,) attention-sink logits or
    None). Returns (T, H*vd)."""
    kc, vc = kv.layer(layer)
    tables = kv.tables(layer, batch)  # (S, MB) block ids, or slots for a trimmed sliding-window layer
    kv.write(layer, batch.slots(tables, kc.shape[1]), k, v)
    plan = batch.attention_plan(tables, kc.shape, q.shape[1], vc.shape[3])
    out = paged_attention(q, kc, vc, batch.positions, batch.row_seq, tables,
                          window=window, scale=scale, softcap=softcap, sinks=sinks, plan=plan)
    return out.reshape(len(q), -1)


class Embedding:
    """Token embedding lookup: rows read with pread and dequantized (the table is never paged in whole)."""

    def __init__(self, loaded: LoadedModel, name: str = "token_embd.weight"):
        self._g, self.name = loaded.gguf, name
        t = self._g.tensors[name]
        self.qtype, self.n_vocab = t.qtype, t.shape[0]

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        """(T,) token ids -> (T, D) float32."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.n_vocab):
            raise ValueError(f"token id out of range [0, {self.n_vocab})")
        uniq, inv = np.unique(tokens, return_inverse=True)
        rows = dequantize(self._g.read_rows(self.name, uniq), self.qtype)  # (U, D)
        return np.ascontiguousarray(rows[inv], dtype=np.float32)


def linear(x: np.ndarray, w, bias: np.ndarray | None = None) -> np.ndarray:
    """x (T, K) @ W.T -> (T, N), plus bias."""
    y = matmul(np.ascontiguousarray(x, dtype=np.float32), w)
    if bias is not None:
        y += bias
    return y


def linears(x: np.ndarray, ws, biases=None) -> list[np.ndarray]:
    """[linear(x, w, b) for w, b in zip(ws, biases)]: one input, x quantized once for all the weights."""
    ys = matmul_many(np.ascontiguousarray(x, dtype=np.float32), list(ws))
    for y, b in zip(ys, biases or [None] * len(ys)):
        if b is not None:
            y += b
    return ys


class CausalLM:
    """What every architecture's Model shares: embedding, output head, forward = logits(hidden(...)).
    Subclasses set `Layer` (built as Layer(weights, index, config)) and implement `hidden`.
    ctx_size: the context the engine will run (some models pick tables by it: phi3's LongRoPE factors)."""

    Layer: type

    def __init__(self, loaded: LoadedModel, *, progress: bool = False, ctx_size: int | None = None):
        cfg = self.cfg = loaded.config
        self.ctx_size = ctx_size
        w = self.weights = Weights(loaded, progress=progress)
        self.embed = Embedding(loaded)
        self.output = w.matrix("token_embd.weight" if cfg.tied_output else "output.weight")
        self.output_norm = w.vector("output_norm.weight")
        self.layers = [self.Layer(w, i, cfg) for i in range(cfg.n_layers)]

    def forward(self, batch: ForwardBatch, kv) -> np.ndarray:
        """Logits (R, n_vocab) for batch.logit_rows; writes this step's K/V into kv."""
        return self.logits(self.hidden(batch, kv))

    def hidden(self, batch: ForwardBatch, kv) -> np.ndarray:  # pragma: no cover - per architecture
        """Final-normed hidden states (R, D) of batch.logit_rows; writes this step's K/V into kv."""
        raise NotImplementedError

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Output head (only for the rows that are sampled): (R, D) -> (R, n_vocab), soft-capped if the
        model says so."""
        c = self.cfg
        if not len(h):
            return np.empty((0, c.n_vocab), dtype=np.float32)
        out = matmul(np.ascontiguousarray(h, dtype=np.float32), self.output)
        if c.final_softcap:
            softcap(out, c.final_softcap)
        return out
