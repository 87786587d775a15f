"""Registry of the fast (Numba) quantizers used by quant.quantize_model; the NumPy references are the spec."""
from __future__ import annotations

from typing import Callable

import numpy as np

from quant.types import QuantType


def fast_quantizer(qtype: QuantType) -> Callable[[np.ndarray], np.ndarray] | None:
    """float32 (n_rows, n_cols) -> uint8 (n_rows, row_bytes) with a Numba kernel, or None if there is none."""
    try:
        from quant.quant_numba import KERNELS
    except ImportError:  # pragma: no cover - numba missing
        return None
    return KERNELS.get(QuantType(qtype))
