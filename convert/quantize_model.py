"""GGUF -> GGUF quantizer: llama.cpp's `llama-quantize` (no imatrix) in NumPy/Numba.

A tool on top of the format library (quant/), the Numba quantizers (kernels_cpu/quantize.py) and the GGUF
reader, beside the HF converter; `edgellm quantize` and `convert_hf(..., outtype="q8_0")` call it.

The input is read with edgellm.gguf_file (one memmap); each tensor is dequantized to float32, quantized to the
type `quant.mixes.plan_types` chose, and streamed to the output with gguf.GGUFWriter, one tensor at a time
(peak memory ~ the largest tensor in float32, not the model). Metadata is copied with its original value
types; general.file_type is set to the mix's id.
"""
from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgellm.errors import EdgeLLMError, InvalidRequestError
from edgellm.gguf_file import GGUFFile, read_gguf
from quant.formats import dequantize, quantize
from quant.mixes import FTYPES, plan_types
from quant.types import FORMATS, QuantType

__all__ = ["RequantizeError", "QuantizeResult", "quantize_model", "quantize_tensor"]

_FLOAT_TYPES = frozenset({QuantType.F32, QuantType.F16, QuantType.BF16})
_ROWS_PER_TASK = 256  # rows per work item when quantizing with several threads


class RequantizeError(EdgeLLMError):
    """The input is already quantized and --allow-requantize was not given."""


@dataclass
class QuantizeResult:
    """What `quantize_model` did: output path, type per tensor, sizes in bytes, seconds."""

    path: str
    types: dict[str, QuantType]
    bytes_in: int
    bytes_out: int
    seconds: float


def quantize_tensor(x: np.ndarray, qtype: QuantType, *, threads: int = 1) -> np.ndarray:
    """float32 (n_rows, n_cols) -> uint8 (n_rows, row_bytes); fast Numba kernels where there is one."""
    from kernels_cpu.quantize import QUANTIZERS  # lazy: loads the Numba kernels only when quantizing

    fn = QUANTIZERS.get(QuantType(qtype)) or (lambda a: quantize(a, qtype))
    if threads <= 1 or x.shape[0] <= _ROWS_PER_TASK:
        return fn(x)
    chunks = [x[i:i + _ROWS_PER_TASK] for i in range(0, x.shape[0], _ROWS_PER_TASK)]
    with ThreadPoolExecutor(threads) as pool:  # the kernels release the GIL
        return np.concatenate(list(pool.map(fn, chunks)))


def quantize_model(src: str | os.PathLike, dst: str | os.PathLike, ftype: str, *, allow_requantize: bool = False,
                   leave_output_tensor: bool = False, threads: int = 1, progress: bool = False) -> QuantizeResult:
    """Quantize the GGUF model `src` to `dst` with llama.cpp's mix `ftype` ("Q4_K_M", "Q8_0", "F16", ...).

    Raises InvalidRequestError-like errors (EdgeLLMError subclasses): unknown ftype, or RequantizeError when a
    tensor to be changed is already quantized and `allow_requantize` is False.
    """
    import time

    import gguf

    t0 = time.perf_counter()
    ftype = ftype.upper()
    if ftype not in FTYPES:
        raise InvalidRequestError(f"unknown quantization type {ftype!r}; choose one of {', '.join(FTYPES)}")
    g = read_gguf(src)
    meta = g.metadata
    arch = str(meta.get("general.architecture", ""))
    n_layers = int(meta.get(f"{arch}.block_count", 0))
    n_head = _first(meta.get(f"{arch}.attention.head_count", 1))
    n_head_kv = _first(meta.get(f"{arch}.attention.head_count_kv", n_head)) or n_head
    infos = list(g.tensors.values())
    types = plan_types([(t.name, t.shape, t.qtype) for t in infos], ftype, n_layers=n_layers,
                       n_gqa=max(1, n_head // max(1, n_head_kv)), n_expert=int(_first(meta.get(f"{arch}.expert_count", 0))),
                       leave_output=leave_output_tensor)
    requant = [t.name for t in infos if types[t.name] != t.qtype and t.qtype not in _FLOAT_TYPES]
    if requant and not allow_requantize:
        raise RequantizeError(f"{g.path}: tensor {requant[0]!r} is already quantized ({g.tensors[requant[0]].qtype.name}); "
                              "requantizing loses quality, pass --allow-requantize to do it anyway")

    w = gguf.GGUFWriter(os.fspath(dst), arch, use_temp_file=False)
    _copy_metadata(w, g, FTYPES[ftype].file_type)
    for t in infos:
        q = types[t.name]
        n_bytes = t.n_elements // FORMATS[q].block_size * FORMATS[q].type_size
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), n_bytes, raw_dtype=gguf.GGMLQuantizationType(int(q)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = _progress(len(infos), progress)
    bytes_out = 0
    for t in infos:
        q = types[t.name]
        raw = g.tensor_bytes(t.name)  # (rows, row_bytes)
        if q == t.qtype:
            out = np.ascontiguousarray(raw)
        else:
            x = dequantize(raw, t.qtype).reshape(-1, t.shape[-1])  # (rows, n_cols) float32
            out = quantize_tensor(x, q, threads=threads)
        w.write_tensor_data(out.reshape(-1))
        bytes_out += out.nbytes
        if bar is not None:
            bar.set_postfix_str(f"{t.name} -> {q.name}", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    w.close()
    return QuantizeResult(os.fspath(dst), types, sum(t.n_bytes for t in infos), bytes_out, time.perf_counter() - t0)


def _first(v) -> int:
    a = np.asarray(v).reshape(-1)
    return int(a.max()) if a.size else 0


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", desc="quantize")


# ---------------------------------------------------------------------------------------------------------------
# Metadata copy with the original value types
# ---------------------------------------------------------------------------------------------------------------

_SKIP_KEYS = {"general.architecture", "general.file_type", "general.alignment"}


def _copy_metadata(w, g: GGUFFile, file_type: int) -> None:
    from gguf import GGUFValueType as V

    types = _kv_types(g.path)
    align = g.metadata.get("general.alignment")
    if align is not None:
        w.data_alignment = int(align)
        w.add_uint32("general.alignment", int(align))
    for key, val in g.metadata.items():
        if key in _SKIP_KEYS:
            continue
        vtype, sub = types[key]
        if vtype == V.ARRAY:
            if sub == V.ARRAY:
                raise EdgeLLMError(f"{g.path}: nested metadata array {key!r} is not supported")
            items = val.tolist() if hasattr(val, "tolist") else list(val)
            if not items:
                continue  # gguf.GGUFWriter cannot write empty arrays
            w.add_key_value(key, items, V.ARRAY, sub_type=V(sub))
        else:
            w.add_key_value(key, val, V(vtype))
    w.add_uint32("general.file_type", file_type)


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _kv_types(path: str) -> dict[str, tuple[int, int | None]]:
    """key -> (value type, array element type) from the GGUF header (edgellm.gguf_file keeps only the values)."""
    with open(path, "rb") as f:
        buf = f.read(8 << 20)
        pos = 8
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, pos)
        pos += 16
        out: dict[str, tuple[int, int | None]] = {}

        def need(n):
            nonlocal buf
            while pos + n > len(buf):
                more = f.read(max(n, 8 << 20))
                if not more:
                    raise EdgeLLMError(f"{path}: truncated GGUF header")
                buf += more

        def string_len():
            nonlocal pos
            need(8)
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8
            return n

        for _ in range(n_kv):
            n = string_len()
            need(n + 4)
            key = buf[pos:pos + n].decode("utf-8", errors="replace")
            pos += n
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            sub = None
            if vtype == 9:  # array
                need(12)
                sub, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if sub == 8:
                    for _ in range(count):
                        n = string_len()  # (not `pos += string_len()`: that reads pos before the call)
                        pos += n
                elif sub in _SIZES:
                    pos += count * _SIZES[sub]
                else:
                    raise EdgeLLMError(f"{path}: unsupported metadata array type {sub} for {key!r}")
            elif vtype == 8:
                n = string_len()
                pos += n
            else:
                pos += _SIZES[vtype]
            out[key] = (vtype, sub)
        return out


def describe(result: QuantizeResult) -> dict[str, Any]:
    """Summary for the CLI: tensor counts per type, sizes in MiB, seconds."""
    from collections import Counter

    return {"path": result.path, "types": dict(Counter(t.name for t in result.types.values())),
            "mib_in": round(result.bytes_in / 2**20, 2), "mib_out": round(result.bytes_out / 2**20, 2),
            "seconds": round(result.seconds, 2)}
