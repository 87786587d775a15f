"""llama.cpp's per-tensor type choice for a quantization mix ("Q4_K_M" ...), as data + small functions.

Follows `llama_tensor_get_type` in llama.cpp's src/llama-quant.cpp for the non-IQ file types and IQ4_NL / IQ4_XS
(dense models, no imatrix, no manual overrides). `plan_types` gives the type of every tensor of a model; the counters of
attn_v / ffn_down tensors run in llama.cpp's tensor order (layer number, then name).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from quant.types import FORMATS, QuantType as T

__all__ = ["FTYPES", "Mix", "plan_types", "tensor_category", "use_more_bits", "fallback_type"]


@dataclass(frozen=True)
class Mix:
    """One llama.cpp file type: its `general.file_type` id and the default type of quantized tensors."""

    file_type: int
    default: T


# llama_ftype ids (llama.h) -> default tensor type (llama_ftype_get_default_type)
FTYPES: dict[str, Mix] = {
    "F32": Mix(0, T.F32), "F16": Mix(1, T.F16), "BF16": Mix(32, T.BF16),
    "Q4_0": Mix(2, T.Q4_0), "Q4_1": Mix(3, T.Q4_1), "Q8_0": Mix(7, T.Q8_0),
    "Q5_0": Mix(8, T.Q5_0), "Q5_1": Mix(9, T.Q5_1),
    "Q2_K": Mix(10, T.Q2_K), "Q3_K_S": Mix(11, T.Q3_K), "Q3_K_M": Mix(12, T.Q3_K), "Q3_K_L": Mix(13, T.Q3_K),
    "Q4_K_S": Mix(14, T.Q4_K), "Q4_K_M": Mix(15, T.Q4_K), "Q5_K_S": Mix(16, T.Q5_K), "Q5_K_M": Mix(17, T.Q5_K),
    "Q6_K": Mix(18, T.Q6_K), "IQ4_NL": Mix(25, T.IQ4_NL), "IQ4_XS": Mix(30, T.IQ4_XS),
    "MXFP4_MOE": Mix(38, T.MXFP4),  # expert tensors MXFP4, everything else Q8_0
}
_IQ4 = ("IQ4_NL", "IQ4_XS")

# tensor_type_fallback: a 256-block type whose row length is not a multiple of 256 -> a 32-block type
_FALLBACK: dict[T, T] = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
                         T.IQ4_XS: T.IQ4_NL}

# category by name (tensor_get_category): first match wins
_CATEGORIES: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("output", lambda n: n == "output.weight"),
    ("token_embd", lambda n: n in ("token_embd.weight", "per_layer_token_embd.weight")),
    ("attn_qkv", lambda n: "attn_qkv.weight" in n),
    ("attn_kv_b", lambda n: "attn_kv_b.weight" in n),
    ("attn_v", lambda n: "attn_v.weight" in n),
    ("attn_k", lambda n: "attn_k.weight" in n),
    ("attn_q", lambda n: "attn_q.weight" in n),
    ("attn_output", lambda n: "attn_output.weight" in n),
    ("ffn_up", lambda n: "ffn_up" in n),
    ("ffn_gate", lambda n: "ffn_gate" in n),
    ("ffn_down", lambda n: "ffn_down" in n),
)
_ATTN_V_LIKE = frozenset({"attn_v", "attn_qkv", "attn_kv_b"})

# names never quantized (tensor_allows_quantization), besides 1-D tensors and names not ending in "weight"
_KEEP_SUBSTRINGS = ("_norm.weight", "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj",
                    "ssm_conv1d", "attn_rel_b.weight", "position_embd", "token_types.weight")


def tensor_category(name: str) -> str:
    for cat, match in _CATEGORIES:
        if match(name):
            return cat
    return "other"


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, and every third in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def fallback_type(qtype: T, n_cols: int) -> T:
    """A type whose block size divides the row length `n_cols` (tensor_type_fallback); F16 as the last resort."""
    if n_cols % FORMATS[qtype].block_size == 0:
        return qtype
    new = _FALLBACK.get(qtype, qtype)
    return new if n_cols % FORMATS[new].block_size == 0 else T.F16


def allows_quantization(name: str, shape: tuple[int, ...], *, leave_output: bool = False) -> bool:
    ne = shape[::-1]  # ggml_n_dims: trailing size-1 dimensions do not count
    if max((i + 1 for i, d in enumerate(ne) if d > 1), default=1) < 2:
        return False
    if not name.endswith("weight") or any(s in name for s in _KEEP_SUBSTRINGS):
        return False
    return not (leave_output and name == "output.weight")


# ---------------------------------------------------------------------------------------------------------------
# Per-category rules. Each gets (ftype, default type, state) and returns the new type; `state` holds the counters.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _State:
    n_attn_v: int
    n_layers: int
    n_gqa: int
    n_expert: int = 0
    i_attn_v: int = 0
    i_ffn_down: int = 0


def _attn_v(ft: str, t: T, s: _State) -> T:
    if ft == "Q2_K":
        t = T.Q4_K if s.n_gqa >= 4 else T.Q3_K
    elif ft == "Q3_K_M":
        t = T.Q5_K if s.i_attn_v < 2 else T.Q4_K
    elif ft == "Q3_K_L":
        t = T.Q5_K
    elif ft in _IQ4 and s.n_gqa >= 4:
        t = T.Q5_K
    elif ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(s.i_attn_v, s.n_attn_v):
        t = T.Q6_K
    elif ft == "Q4_K_S" and s.i_attn_v < 4:
        t = T.Q5_K
    if s.n_expert == 8:  # llama.cpp: "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
        t = T.Q8_0
    s.i_attn_v += 1
    return t


def _ffn_down(ft: str, t: T, s: _State) -> T:
    i, n = s.i_ffn_down, s.n_layers
    if ft == "Q2_K":
        t = T.Q3_K
    elif ft == "Q3_K_M":
        t = T.Q5_K if i < n // 16 else T.Q4_K  # non-Falcon: use_more_bits or not, Q4_K
    elif ft == "Q3_K_L":
        t = T.Q5_K
    elif ft == "Q4_K_M":
        if use_more_bits(i, n):
            t = T.Q6_K
    elif ft in _IQ4 and i < n // 8:  # without an imatrix
        t = T.Q5_K
    elif ft == "Q5_K_M" and use_more_bits(i, n):
        t = T.Q6_K
    elif ft == "Q4_K_S" and i < n // 8:
        t = T.Q5_K
    s.i_ffn_down += 1
    return t


_ATTN_OUTPUT: dict[str, T] = {"Q2_K": T.Q3_K, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K}
_ATTN_OUTPUT_8_EXPERTS = frozenset({"Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS"})


def _attn_output(ft: str, t: T, s: _State) -> T:
    if s.n_expert == 8:
        return T.Q5_K if ft in _ATTN_OUTPUT_8_EXPERTS else t
    return _ATTN_OUTPUT.get(ft, t)
_ATTN_QKV: dict[str, T] = {"Q3_K_M": T.Q4_K, "Q3_K_L": T.Q4_K, "Q4_K_M": T.Q5_K, "Q5_K_M": T.Q6_K}


def _output(t: T, n_cols: int) -> T:
    """output.weight (and a tied token_embd): Q6_K unless the default is Q8_0; Q8_0 if rows do not fit."""
    if n_cols % FORMATS[t].block_size:
        return T.Q8_0
    return t if t == T.Q8_0 else T.Q6_K


_RULES: dict[str, Callable[[str, T, _State], T]] = {
    "attn_v": _attn_v,
    "attn_kv_b": _attn_v,
    "attn_qkv": lambda ft, t, s: _ATTN_QKV.get(ft, _attn_v(ft, t, s)),
    "ffn_down": _ffn_down,
    "attn_output": _attn_output,
    "attn_k": lambda ft, t, s: T.Q8_0 if s.n_expert == 8 else t,
}


def _layer_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def plan_types(tensors: list[tuple[str, tuple[int, ...], T]], ftype: str, *, n_layers: int, n_gqa: int = 1,
               n_expert: int = 0, leave_output: bool = False) -> dict[str, T]:
    """Target type per tensor for llama.cpp file type `ftype`.

    tensors: (name, row-major shape, current type) for every tensor of the model.
    n_layers: `{arch}.block_count`; n_gqa: n_head // n_head_kv; n_expert: `{arch}.expert_count` (0: dense).
    """
    mix = FTYPES[ftype]
    default = mix.default
    quantized_default = default not in (T.F32, T.F16, T.BF16)
    names = {n for n, _, _ in tensors}
    tied = "output.weight" not in names
    cats = {n: tensor_category(n) for n in names}
    state = _State(n_attn_v=sum(c in _ATTN_V_LIKE for c in cats.values()), n_layers=n_layers, n_gqa=n_gqa,
                   n_expert=n_expert)
    out: dict[str, T] = {}
    # llama.cpp visits tensors by layer number (non-layer tensors first), then by name: the counters follow that
    for name, shape, cur in sorted(tensors, key=lambda t: (_layer_of(t[0]), t[0])):
        if not allows_quantization(name, shape, leave_output=leave_output):
            out[name] = cur
            continue
        t = default
        if quantized_default:
            cat = cats[name]
            if ftype == "MXFP4_MOE":  # llama.cpp: 3-D expert tensors MXFP4, all others (output included) Q8_0
                t = T.MXFP4 if len(shape) >= 3 and shape[-3] > 1 and cat not in ("output", "token_embd") else T.Q8_0
            elif cat == "output" or (tied and cat == "token_embd"):
                t = _output(t, shape[-1])
            elif cat in _RULES:
                t = _RULES[cat](ftype, t, state)
            t = fallback_type(t, shape[-1])
        out[name] = t
    return out
