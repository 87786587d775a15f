"""Golden bytes of llama.cpp's own quantizer for IQ4_NL, IQ4_XS and MXFP4 (no importance matrix).

    PYTHONPATH=/path/to/llama-cpp-python python tests/golden/make_iquant_golden.py   # the `bench` extra

Calls ggml_quantize_chunk (libggml-base of llama-cpp-python) on the rows of `inputs()` and stores inputs and
outputs in tests/golden/iquant_golden.npz; tests/test_iquants.py quantizes the same rows with quant/iquants.py
and compares byte for byte.
"""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TYPES = {"IQ4_NL": 20, "IQ4_XS": 23, "MXFP4": 39}
N_PER_ROW = 512


def inputs() -> np.ndarray:
    """(rows, 512) float32: normal rows over a wide range of scales, heavy tails, rows with zero and constant
    blocks, tiny values, and values on the codebooks' grid points (ties)."""
    rng = np.random.default_rng(20261202)
    rows = [rng.standard_normal(N_PER_ROW) * s for s in (1e-3, 0.02, 1.0, 30.0, 1e4)]
    rows += [rng.standard_t(2, N_PER_ROW), rng.laplace(size=N_PER_ROW), rng.uniform(-1, 1, N_PER_ROW)]
    z = rng.standard_normal(N_PER_ROW)
    z[:64] = 0.0  # whole zero blocks
    z[64:96] = 0.25  # a constant block
    rows.append(z)
    grid = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
    rows.append(rng.choice(grid, N_PER_ROW) / 127.0)
    rows.append(rng.choice(np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32), N_PER_ROW)
                * rng.choice([-1, 1], N_PER_ROW))
    rows += [rng.standard_normal(N_PER_ROW) * 1e-20, rng.standard_normal(N_PER_ROW) * np.exp(rng.uniform(-8, 8))]
    rows += list(rng.standard_normal((20, N_PER_ROW)) * rng.uniform(0.01, 3, (20, 1)))
    return np.asarray(rows, dtype=np.float32)


def main() -> None:
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    x = np.ascontiguousarray(inputs())
    out = {"x": x}
    for name, t in TYPES.items():
        lib.ggml_quantize_init(t)
        buf = np.zeros(x.shape[0] * N_PER_ROW * 2, dtype=np.uint8)  # ample
        n = lib.ggml_quantize_chunk(t, x.ctypes.data, buf.ctypes.data, 0, x.shape[0], N_PER_ROW, None)
        out[name] = buf[:n].reshape(x.shape[0], -1)
    np.savez_compressed(HERE / "iquant_golden.npz", **out)
    (HERE / "iquant_golden.json").write_text(json.dumps({
        "description": "llama.cpp ggml_quantize_chunk output (no imatrix) for the rows in iquant_golden.npz['x']",
        "types": TYPES, "llama_cpp_python": llama_cpp.__version__}, indent=1) + "\n")
    print("wrote", HERE / "iquant_golden.npz")


if __name__ == "__main__":
    main()
