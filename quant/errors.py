"""The format library's own error, so that quant/ depends on nothing of ours.

edgellm.errors.UnsupportedQuantTypeError subclasses it: `except QuantTypeError` catches both what the library
raises and what the model loader raises for an unsupported tensor type.
"""
from __future__ import annotations

__all__ = ["QuantTypeError"]


class QuantTypeError(Exception):
    """A quant type without a reference (de)quantizer, or an id that is no GGML type at all."""
