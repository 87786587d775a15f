"""GGUF quantization formats: the type registry and NumPy reference (de)quantization."""
from quant.types import QuantType, FORMATS, Format, row_bytes
from quant.formats import dequantize, dequantize_rows, quantize, k_scale_min, q3_k_scales

__all__ = [
    "QuantType", "FORMATS", "Format", "row_bytes",
    "dequantize", "dequantize_rows", "quantize", "k_scale_min", "q3_k_scales",
]
