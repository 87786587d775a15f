"""Quantization types as data: GGML type id -> (block_size in elements, type_size in bytes)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class QuantType(IntEnum):
    """GGML tensor types (ids as in ggml.h / gguf.GGMLQuantizationType)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ4_NL = 20
    IQ4_XS = 23
    BF16 = 30
    MXFP4 = 39


@dataclass(frozen=True)
class Format:
    """Byte layout of one quantized block: `block_size` weights stored in `type_size` bytes."""

    block_size: int
    type_size: int


QK_K = 256  # super-block size of the k-quants

# Layouts as arithmetic, as in ggml-common.h (d/m are f16 = 2 bytes).
FORMATS: dict[QuantType, Format] = {
    QuantType.F32: Format(1, 4),
    QuantType.F16: Format(1, 2),
    QuantType.BF16: Format(1, 2),
    QuantType.Q4_0: Format(32, 2 + 16),
    QuantType.Q4_1: Format(32, 2 + 2 + 16),
    QuantType.Q5_0: Format(32, 2 + 4 + 16),
    QuantType.Q5_1: Format(32, 2 + 2 + 4 + 16),
    QuantType.Q8_0: Format(32, 2 + 32),
    QuantType.Q8_1: Format(32, 4 + 4 + 32),
    QuantType.Q2_K: Format(QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    QuantType.Q3_K: Format(QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    QuantType.Q4_K: Format(QK_K, 2 + 2 + 12 + QK_K // 2),
    QuantType.Q5_K: Format(QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    QuantType.Q6_K: Format(QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    QuantType.Q8_K: Format(QK_K, 4 + QK_K + QK_K // 16 * 2),
    QuantType.IQ4_NL: Format(32, 2 + 16),
    QuantType.IQ4_XS: Format(QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),
    QuantType.MXFP4: Format(32, 1 + 16),
}

# Types a GGUF file's tensors may have (Q8_1 / Q8_K are activation-only formats in llama.cpp).
STORAGE_TYPES = frozenset(FORMATS) - {QuantType.Q8_1, QuantType.Q8_K}
# Formats with a NumPy reference but no matmul kernel yet: loading a model that computes with them is refused with
# the named unsupported-type error until kernels_cpu has them (none today: IQ4_NL, IQ4_XS and MXFP4 have
# kernels_cpu/matmul_iq.py).
REFERENCE_ONLY: frozenset[QuantType] = frozenset()
# Types a model's weights may use for inference.
WEIGHT_TYPES = STORAGE_TYPES - REFERENCE_ONLY


def row_bytes(qtype: QuantType, n_elements: int) -> int:
    """Bytes taken by one row of `n_elements` values; raises ValueError if not a whole number of blocks."""
    fmt = FORMATS[qtype]
    if n_elements % fmt.block_size:
        raise ValueError(f"{qtype.name}: row of {n_elements} is not a multiple of {fmt.block_size}")
    return n_elements // fmt.block_size * fmt.type_size
