"""OpenAI-compatible HTTP server (FastAPI + uvicorn; install with `pip install edgellm[server]`).

`create_app(llm)` gives the ASGI app; `edgellm serve` runs it. Imported lazily: the core package does not need
these dependencies."""


def create_app(*args, **kwargs):
    """See edgellm.server.app.create_app."""
    from edgellm.server.app import create_app as _create_app

    return _create_app(*args, **kwargs)


__all__ = ["create_app"]
