"""The HTTP server: OpenAI-compatible routes over one LLM, SSE streaming, Prometheus metrics, API-key auth.

The engine runs in its own thread (EngineLoop); routes only tokenize (in the thread pool), submit, and await the
pieces the engine thread hands over through `loop.call_soon_threadsafe`, so the event loop never waits on a
forward pass. A request whose client goes away is cancelled at once; its KV blocks return at the next step.
"""
from __future__ import annotations

import hmac
import threading
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgellm.errors import EdgeLLMError
from edgellm.server import protocol as P
from edgellm.server.generation import Generation
from edgellm.server.helpers import (_card, _chat_prompt, _check_common, _completion_logprobs, _completion_prompts,
                                    _params, _sse, _stream_response, _tokenized, _usage, error_reply)
from edgellm.server.ollama_protocol import OllamaError
from edgellm.server.state import ERROR_RESPONSES, ServerState, error_status, log

_bearer = HTTPBearer(auto_error=False, description="Set when the server runs with --api-key.")


# -- the app ------------------------------------------------------------------------------------------------
def create_app(llm=None, *, model: str | None = None, llm_kwargs: dict | None = None, api_key: str | None = None,
               max_queue: int = 64, model_id: str | None = None, webui: bool = True) -> FastAPI:
    """The ASGI app. Pass a ready `llm` (tests share one), or `model` + `llm_kwargs` to load it in a background
    thread at startup (/health answers 503 until it is ready). webui: the chat page at / and the dashboard
    (edgellm/server/webui.py)."""
    state = ServerState(llm, model=model, llm_kwargs=llm_kwargs, api_key=api_key, max_queue=max_queue,
                        model_id=model_id)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.llm is None:
            threading.Thread(target=state.load, name="edgellm-load", daemon=True).start()
        yield
        if state.owns_llm and state.llm is not None:
            state.llm.shutdown()

    app = FastAPI(title="edgellm", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible LLM inference on CPU from GGUF files.")
    app.state.server = state

    def openapi() -> dict:  # validation errors are 400 here, not FastAPI's 422: document what is sent
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    async def authorized(creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), state.api_key.encode()):
            state.metrics.rejected.labels("401").inc()
            raise P.APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                             code="invalid_api_key")

    async def ready() -> ServerState:
        why = state.unavailable()
        if why is not None:
            raise P.APIError(503, why, type="service_unavailable", headers={"Retry-After": "5"})
        return state

    guarded = [Depends(authorized)] if api_key else []  # no key: no security scheme in /openapi.json either

    # -- errors in OpenAI's shape (Ollama's under /api/) --
    @app.exception_handler(OllamaError)
    async def _ollama_error(request: Request, e: OllamaError):
        return JSONResponse({"error": e.message}, status_code=e.status)

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        return error_reply(request, e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(EdgeLLMError)
    async def _edgellm_error(request: Request, e: EdgeLLMError):
        status, kind, code = error_status(e)
        return error_reply(request, P.error_body(str(e), kind, None, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            why = (first.get("ctx") or {}).get("error", "JSON decode error")
            return error_reply(request, P.error_body(f"malformed JSON body: {why}", "invalid_request_error", None,
                                                     "invalid_json"), status_code=400)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg')}"
                        for err in errs[:5])
        return error_reply(request, P.error_body(msg or "invalid request", "invalid_request_error",
                                                 ".".join(loc) or None, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_reply(request, P.error_body(str(e.detail), "invalid_request_error"),
                           status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("internal error")
        return error_reply(request, P.error_body(f"{type(e).__name__}: {e}", "server_error"), status_code=500)

    if webui:
        from edgellm.server.webui import register_webui

        register_webui(app, state, guarded, ready)

    # -- service routes --
    @app.get("/health", response_model=P.Health, responses={503: {"model": P.Health}})
    async def health():
        if state.unavailable() is not None:
            status = "loading" if state.llm is None and state.load_error is None else "error"
            return JSONResponse({"status": status}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=P.ModelList, dependencies=guarded, responses=ERROR_RESPONSES)
    async def models(s: ServerState = Depends(ready)):
        return {"object": "list", "data": [_card(s)]}

    @app.get("/v1/models/{model}", response_model=P.ModelCard, dependencies=guarded, responses=ERROR_RESPONSES)
    async def model_card(model: str, s: ServerState = Depends(ready)):
        if model not in s.aliases:
            raise P.APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return _card(s)

    @app.post("/tokenize", response_model=P.TokenizeResponse, dependencies=guarded, responses=ERROR_RESPONSES)
    async def tokenize(body: P.TokenizeRequest, s: ServerState = Depends(ready)):
        _check_common(s, body)
        if (body.prompt is None) == (body.messages is None):
            raise P.APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            ids = await _tokenized(_chat_prompt, s, body.messages)
        else:
            ids = await _tokenized(lambda: s.llm.tokenizer.encode(
                body.prompt, add_bos=None if body.add_special_tokens else False, special=True))
        return {"tokens": ids, "count": len(ids), "max_model_len": s.max_len}

    @app.post("/detokenize", response_model=P.DetokenizeResponse, dependencies=guarded, responses=ERROR_RESPONSES)
    async def detokenize(body: P.DetokenizeRequest, s: ServerState = Depends(ready)):
        _check_common(s, body)
        n_vocab = s.llm.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < n_vocab]
        if bad:
            raise P.APIError(400, f"token id {bad[0]} out of range [0, {n_vocab})", param="tokens")
        return {"prompt": s.llm.detokenize(body.tokens)}

    # -- generation --
    from edgellm.server import chat_routes

    chat_routes.register(app, ready, guarded)
    from edgellm.server import embeddings as embedding_routes, ollama, responses

    embedding_routes.register(app, ready, guarded)
    ollama.register(app, ready, guarded, root=not webui)  # with the web UI, / is the chat page
    responses.register(app, ready, guarded)

    @app.post("/v1/completions", dependencies=guarded, response_model=P.Completion,
              responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
    async def completions(body: P.CompletionRequest, request: Request, s: ServerState = Depends(ready)):
        _check_common(s, body)
        if body.suffix:
            raise P.APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise P.APIError(400, "best_of must equal n (no server-side ranking)", param="best_of")
        prompts = await _tokenized(_completion_prompts, s, body.prompt)
        ids, params = _params(s, body, prompts, "prompt", body.logprobs)
        gen = Generation(s, ids, params)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": s.model_id}
        k = body.logprobs
        echo = [s.llm.tokenizer.decode(p, skip_special=True) if body.echo else "" for p in ids]
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            offsets = {c.index: len(echo[c.index]) for c in gen.choices}

            async def chunks():
                for c in gen.choices:
                    if echo[c.index]:
                        yield _sse({**head, "choices": [{"index": c.index, "text": echo[c.index], "logprobs": None,
                                                         "finish_reason": None}]})
                async for c, piece, n, finished in gen.events():
                    if not (piece or finished):
                        continue
                    lp = None
                    if k is not None:
                        lp, offsets[c.index] = _completion_logprobs(s, c, n, offsets[c.index])
                    c.sent = n
                    yield _sse({**head, "choices": [{"index": c.index, "text": piece, "logprobs": lp,
                                                     "finish_reason": c.finish_reason if finished else None}],
                                **({"usage": None} if usage else {})})
                if usage:
                    yield _sse({**head, "choices": [], "usage": _usage(gen, prompts)})

            return _stream_response(gen, chunks())
        await gen.collect(request)
        choices = []
        for c in gen.choices:
            lp = None
            if k is not None:
                lp = _completion_logprobs(s, c, len(c.request.output_ids), len(echo[c.index]))[0]
            choices.append({"index": c.index, "text": echo[c.index] + c.request.text, "logprobs": lp,
                            "finish_reason": c.finish_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": s.model_id,
                "choices": choices, "usage": _usage(gen, prompts), "system_fingerprint": None}

    return app
