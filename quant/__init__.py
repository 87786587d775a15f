"""GGUF quantization formats: the type registry and NumPy reference (de)quantization.

A leaf package: it imports nothing of ours. Names are loaded on first use, so that `import quant.errors`
(which edgellm.errors does) does not pull in NumPy and the formats.
"""
import importlib

_LAZY = {
    "QuantType": "quant.types", "FORMATS": "quant.types", "Format": "quant.types", "row_bytes": "quant.types",
    "dequantize": "quant.formats", "dequantize_rows": "quant.formats", "quantize": "quant.formats",
    "k_scale_min": "quant.formats", "q3_k_scales": "quant.formats",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'quant' has no attribute {name!r}")
