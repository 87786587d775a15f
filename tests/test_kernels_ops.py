"""Element-wise ops of kernels_cpu.ops against llama.cpp's (ggml-cpu) arithmetic."""
from __future__ import annotations

import hashlib

import numpy as np

from kernels_cpu.ops import GELU_F16, geglu

# sha256 of ggml_table_gelu_f16 (libggml-cpu of llama-cpp-python 0.3.36, x86-64) at the finite f16 inputs, read
# from the library after ggml_cpu_init(); non-finite inputs never index the table (ggml_vec_geglu_f32 handles
# |x| >= 10 apart and a NaN gives NaN either way)
GGML_GELU_F16_SHA256 = "6be7bd8fd6b8a8fb4b704136976fc0173a0d12de047f1322f1e97fb20723bef7"


def _finite_f16() -> np.ndarray:
    return np.isfinite(np.arange(65536, dtype=np.uint16).view(np.float16))


def test_gelu_table_is_ggmls():
    with np.errstate(over="ignore", invalid="ignore"):
        bits = GELU_F16.astype(np.float16).view(np.uint16)
    assert hashlib.sha256(bits[_finite_f16()].tobytes()).hexdigest() == GGML_GELU_F16_SHA256
    # entries where a float32 tanh without the fma llama.cpp's build uses is one f16 step off (1 + tanh cancels)
    for idx, want in ((48965, 0xAC06), (49159, 0xA9A9), (49695, 0x9A21), (49865, 0x93A2)):
        assert bits[idx] == want, (idx, hex(bits[idx]))


def test_geglu_uses_table_and_cutoffs():
    gate = np.float32([[-12.0, -10.0, -3.0605469, 0.5, 9.99, 10.0, 12.5]])
    up = np.float32([[2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    got = geglu(gate, up)
    idx = gate.astype(np.float16).view(np.uint16)
    want = GELU_F16[idx] * up
    want[0, :2] = 0.0  # x <= -10: 0
    want[0, 5:] = gate[0, 5:] * up[0, 5:]  # x >= 10: x * up
    np.testing.assert_array_equal(got, want)
