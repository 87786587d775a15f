"""Shared fixtures: tiny random GGUF models (written once per session) and the default model path."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import write_tiny_model  # noqa: E402

# Numba caches compiled kernels next to the sources; keep tests' threads modest on a 2-core box.
os.environ.setdefault("EDGELLM_TEST", "1")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """Factory: path of a tiny model for an architecture (cached per session)."""
    made: dict = {}

    def make(arch: str = "llama", **kw) -> str:
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            path = tiny_dir / f"{arch}-{len(made)}.gguf"
            write_tiny_model(path, arch, **kw)
            made[key] = str(path)
        return made[key]

    return make


@pytest.fixture(scope="session")
def default_model() -> str:
    from edgellm.model_path import default_model_path

    return str(default_model_path(progress=False))


@pytest.fixture(scope="session")
def gemma_llm():
    """The default model loaded once for the whole session."""
    from edgellm import LLM

    return LLM(progress=False)


@pytest.fixture(scope="session")
def gemma_server(gemma_llm):
    """One HTTP server (edgellm/server, web UI on) over the session's default model, for the API tests."""
    from server_thread import ServerThread

    from edgellm.server.app import create_app

    srv = ServerThread(create_app(gemma_llm))
    yield srv
    srv.stop()
