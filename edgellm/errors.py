"""Named errors. Every failure a user can cause raises one of these (CLI: one line, exit code 2)."""
from quant.errors import QuantTypeError


class EdgeLLMError(Exception):
    """Base class of every error edgellm raises on bad input or a missing resource."""


class GGUFError(EdgeLLMError):
    """The file is not a readable GGUF file (bad magic, version, truncated, tensor out of bounds)."""


class UnsupportedModelError(EdgeLLMError):
    """The GGUF file is valid but describes an architecture or tensor type edgellm cannot run."""


class UnsupportedQuantTypeError(UnsupportedModelError, QuantTypeError):
    """A tensor uses a quantization type edgellm has no kernel for (also a quant.errors.QuantTypeError)."""


class ModelNotFoundError(EdgeLLMError):
    """The model named (a path, a pulled name, REPO[:QUANT]) is not there: no such file, not pulled while offline,
    no such repo or quant on the Hub; or no model was given and the bundled default model is not installed."""


class ModelDownloadError(EdgeLLMError):
    """A pull failed: the Hub cannot be reached, a download kept failing, or the disk is full."""


class ChecksumMismatchError(ModelDownloadError):
    """A downloaded file's size or sha256 differs from the Hub's metadata (it was deleted, nothing was stored)."""


class ContextOverflowError(EdgeLLMError):
    """The prompt (plus the requested new tokens) does not fit in the context."""


class InvalidRequestError(EdgeLLMError):
    """A request parameter is out of range or of the wrong type."""


# -- the engine loop (edgellm/engine/loop.py) -----------------------------------------------------------------
class EngineStoppedError(EdgeLLMError):
    """The engine loop was shut down: new requests are refused and the ones in flight end with this error."""


class EngineDeadError(EngineStoppedError):
    """The engine thread stopped on an unexpected error (an engine bug). Every request in flight and every later
    one fails with this error; its ``__cause__`` is the original exception. Load the model again to go on."""


class EngineStepError(EdgeLLMError):
    """The engine step that ran this request failed (its forward raised); the cause is chained. Other requests
    go on."""


class DraftModelError(UnsupportedModelError):
    """A speculative draft model cannot draft for the target: its vocabulary differs (tokens must mean the same)."""
