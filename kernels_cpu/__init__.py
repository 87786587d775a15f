"""CPU kernels (Numba): fused dequantizing matmul for GGUF weights, attention, element-wise ops.

Public matmul API:
    prepare_weight(raw, qtype, shape) -> PreparedWeight   # repack GGUF bytes once at load time
    matmul(x, pw, out=None) -> y                          # y (M, N) = x (M, K) @ W.T
    matmul_many(x, [pw, ...]) -> [y, ...]                 # one input, several weights: x quantized once
    get_rows(pw, ids) -> rows                             # dequantized rows (embedding lookup)
    set_threads(n)                                        # kernel threads (default: physical cores, chosen
                                                          # by the first kernel call if not set before)
"""
from ._jit import physical_cores
from .matmul import PreparedWeight, get_rows, matmul, matmul_many, prepare_weight
from .parallel import get_threads, set_threads

__all__ = ["PreparedWeight", "get_rows", "get_threads", "matmul", "matmul_many", "physical_cores", "prepare_weight",
           "set_threads"]
