"""edgellm: lightweight LLM inference for CPUs and edge devices (GGUF models, Numba kernels).

Public names: LLM, SamplingParams, Engine, load_model, and the errors (EdgeLLMError and subclasses).
Heavy modules are imported on first use so `edgellm --help` stays instant.
"""
from edgellm.errors import (ChecksumMismatchError, ContextOverflowError, DraftModelError, EdgeLLMError,
                            EngineDeadError, EngineStoppedError, GGUFError, InvalidRequestError, ModelDownloadError,
                            ModelNotFoundError, UnsupportedModelError, UnsupportedQuantTypeError)

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("edgellm.api", "LLM"),
    "load_model": ("edgellm.api", "load_model"),
    "SamplingParams": ("edgellm.sampling", "SamplingParams"),
    "Engine": ("edgellm.engine.engine", "Engine"),
    "RequestOutput": ("edgellm.engine.request", "RequestOutput"),
    "program": ("edgellm.program", "program"),
    "gen": ("edgellm.program", "gen"),
    "select": ("edgellm.program", "select"),
    "system": ("edgellm.program", "system"),
    "user": ("edgellm.program", "user"),
    "assistant": ("edgellm.program", "assistant"),
}

__all__ = ["LLM", "SamplingParams", "Engine", "load_model", "RequestOutput", "EdgeLLMError", "GGUFError",
           "UnsupportedModelError", "UnsupportedQuantTypeError", "ModelNotFoundError", "ContextOverflowError",
           "InvalidRequestError", "EngineStoppedError", "EngineDeadError", "ModelDownloadError",
           "ChecksumMismatchError", "DraftModelError"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'edgellm' has no attribute {name!r}")
