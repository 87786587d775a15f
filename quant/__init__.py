"""GGUF quantization formats: the type registry and NumPy reference (de)quantization."""
from quant.types import QuantType, FORMATS, Format, row_bytes

__all__ = ["QuantType", "FORMATS", "Format", "row_bytes"]
