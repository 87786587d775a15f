"""edgellm's own cache directory (the assembled default model, repacked weights, chat history, pulled.json)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """User cache directory of edgellm (platform-specific; $EDGELLM_CACHE overrides)."""
    if os.environ.get("EDGELLM_CACHE"):
        return Path(os.environ["EDGELLM_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("edgellm"))
