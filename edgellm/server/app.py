"""The HTTP server: OpenAI-compatible routes over one LLM, SSE streaming, Prometheus metrics, API-key auth.

The engine runs in its own thread (EngineLoop); routes only tokenize (in the thread pool), submit, and await the
pieces the engine thread hands over through `loop.call_soon_threadsafe`, so the event loop never waits on a
forward pass. A request whose client goes away is cancelled at once; its KV blocks return at the next step.
"""
from __future__ import annotations

import hmac
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgellm import errors
from edgellm.errors import ContextOverflowError, EdgeLLMError, EngineStoppedError
from edgellm.server import protocol as P
from edgellm.server.generation import Choice, Generation
from edgellm.server.metrics import ServerMetrics

log = logging.getLogger("edgellm.server")
ERROR_RESPONSES = {code: {"model": P.ErrorResponse} for code in (400, 401, 404, 429, 503)}
_bearer = HTTPBearer(auto_error=False, description="Set when the server runs with --api-key.")

# A named error -> (HTTP status, OpenAI error type, code); the nearest class in its MRO decides.
ERROR_STATUS: dict[type, tuple[int, str, str | None]] = {
    EdgeLLMError: (400, "invalid_request_error", None),
    ContextOverflowError: (400, "invalid_request_error", "context_length_exceeded"),
    EngineStoppedError: (503, "service_unavailable", "engine_unavailable"),
}
ERROR_STATUS[errors.EngineStepError] = (500, "server_error", "engine_step_failed")  # a failed engine step


def error_status(e: BaseException) -> tuple[int, str, str | None]:
    """(status, type, code) of an error raised to a route (anything unnamed is a 500 server_error)."""
    return next((ERROR_STATUS[c] for c in type(e).__mro__ if c in ERROR_STATUS), (500, "server_error", None))


class ServerState:
    """What the routes share: the LLM (None while it loads), limits from its capacity, counters, metrics."""

    def __init__(self, llm=None, *, model: str | None = None, llm_kwargs: dict | None = None,
                 api_key: str | None = None, max_queue: int = 64, model_id: str | None = None):
        self.llm = None
        self.model_path, self.llm_kwargs = model, dict(llm_kwargs or {})
        self.api_key, self.max_queue, self.model_id = api_key, max_queue, model_id
        self.owns_llm = llm is None
        self.load_error: BaseException | None = None
        self.n_active = 0  # engine requests submitted and not yet released
        self._lock = threading.Lock()
        self.metrics = ServerMetrics(self)
        self.aliases: set[str] = set()
        if llm is not None:
            self._ready(llm)

    def load(self) -> None:
        """Load the model (run in a thread: /health answers 503 meanwhile)."""
        try:
            from edgellm.api import LLM

            self._ready(LLM(self.model_path, **self.llm_kwargs))
            log.info("model %s ready", self.model_id)
        except BaseException as e:  # reported by /health and every route
            self.load_error = e
            log.error("loading the model failed: %s", e)

    def _ready(self, llm) -> None:
        self.model_id = self.model_id or Path(llm.loaded.path).stem
        self.aliases = {self.model_id, llm.loaded.path, str(llm.loaded.metadata.get("general.name", self.model_id))}
        cap = llm.capacity
        self.max_len = cap.max_len
        self.capacity = cap.max_batch + self.max_queue
        self.created = int(time.time())
        self.llm = llm  # last: this is the readiness flag

    def unavailable(self) -> str | None:
        """Why the routes cannot serve (loading, failed to load, engine stopped or dead), or None."""
        if self.llm is None:
            return f"model failed to load: {self.load_error}" if self.load_error else "model is loading"
        err = self.llm.error
        return None if err is None else str(err)

    # -- admission --------------------------------------------------------------------------------------------
    def reserve(self, k: int) -> None:
        """Count k new engine requests in, or raise 429 if the queue is full."""
        if k > self.capacity:
            raise P.APIError(400, f"request asks for {k} sequences; this server runs at most {self.capacity} at once",
                             param="n")
        with self._lock:
            if self.n_active + k > self.capacity:
                self.metrics.rejected.labels("429").inc()
                raise P.APIError(429, f"the server is busy ({self.n_active} requests in flight, queue of "
                                      f"{self.max_queue} full); retry later", type="rate_limit_error",
                                 code="rate_limit_exceeded", headers={"Retry-After": "1"})
            self.n_active += k

    def release(self, k: int = 1) -> None:
        with self._lock:
            self.n_active -= k


# -- building prompts and parameters -------------------------------------------------------------------------
def _chat_prompt(state: ServerState, messages) -> list[int]:
    llm = state.llm
    return llm.prompt_ids(llm.render_chat(P.message_dicts(messages), add_generation_prompt=True))


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    return [state.llm.prompt_ids(p) for p in items]


async def _tokenized(fn, *args):
    """Run tokenization in the thread pool; text the tokenizer cannot take (lone surrogates) is a 400."""
    try:
        return await run_in_threadpool(fn, *args)
    except UnicodeError as e:
        raise P.APIError(400, f"text is not valid Unicode: {e}") from None


def _budget(state: ServerState, req, prompts: list[list[int]], param: str) -> int:
    """max_tokens for these prompts: as asked if prompt + max_tokens fits the context, else a 400."""
    asked = P.max_new_tokens(req)
    longest = max(len(p) for p in prompts)
    if not longest:
        raise P.APIError(400, "the prompt is empty", param=param)
    if asked is None:
        asked = state.max_len - longest
        if asked >= 1:
            return asked
        asked = 1
    if longest + asked > state.max_len:
        raise P.APIError(400, f"This model's maximum context length is {state.max_len} tokens. However, you "
                              f"requested {longest + asked} tokens ({longest} in the {param}, {asked} in the "
                              f"completion). Please reduce the length of the {param} or completion.",
                         param=param, code="context_length_exceeded")
    return asked


def _check_common(state: ServerState, req) -> None:
    if req.model is not None and req.model not in state.aliases:
        raise P.APIError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found")


def _params(state: ServerState, req, prompts: list[list[int]], param: str, logprobs: int | None):
    """(prompt ids, SamplingParams) per choice: each prompt n times, choice index = prompt * n + i."""
    max_tokens = _budget(state, req, prompts, param)
    n_vocab = state.llm.config.n_vocab
    ids, params = [], []
    for p in prompts:
        for i in range(req.n):
            ids.append(p)
            params.append(P.sampling_params(req, max_tokens=max_tokens, n_vocab=n_vocab, logprobs=logprobs,
                                            choice=len(params)))
    return ids, params


def _piece(state: ServerState, tok: int) -> tuple[str, list[int]]:
    b = state.llm.tokenizer.token_to_piece(tok)
    return b.decode("utf-8", "replace"), list(b)


def _chat_logprobs(state: ServerState, c: Choice, upto: int) -> dict:
    req, out = c.request, []
    for tok, (lp, top) in zip(req.output_ids[c.sent:upto], req.logprobs[c.sent:upto]):
        s, b = _piece(state, tok)
        alts = [dict(zip(("token", "bytes"), _piece(state, t)), logprob=v) for t, v in top]
        out.append({"token": s, "logprob": lp, "bytes": b, "top_logprobs": alts})
    return {"content": out}


def _completion_logprobs(state: ServerState, c: Choice, upto: int, offset: int) -> tuple[dict, int]:
    req = c.request
    d = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, (lp, top) in zip(req.output_ids[c.sent:upto], req.logprobs[c.sent:upto]):
        s = _piece(state, tok)[0]
        d["tokens"].append(s)
        d["token_logprobs"].append(lp)
        d["top_logprobs"].append({_piece(state, t)[0]: v for t, v in top})
        d["text_offset"].append(offset)
        offset += len(s)
    return d, offset


def _usage(gen: Generation, prompts: list[list[int]]) -> dict:
    p = sum(len(x) for x in prompts)
    g = sum(len(c.request.output_ids) for c in gen.choices)
    return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


def _card(s: ServerState) -> dict:
    return {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "edgellm",
            "max_model_len": s.max_len}


def _sse(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _EventStream(EventSourceResponse):
    """SSE response that cancels its generation however the response ends (even if the client left before the
    body started)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _stream_response(gen: Generation, events: AsyncIterator[str]):
    async def body():
        try:
            async for data in events:
                yield {"data": data}
        except P.APIError as e:
            yield {"data": _sse(e.body())}
        except EdgeLLMError as e:
            _, kind, code = error_status(e)
            yield {"data": _sse(P.error_body(str(e), kind, None, code))}
        except Exception as e:  # the headers are gone: report in the stream, then end it
            log.exception("stream failed")
            yield {"data": _sse(P.error_body(f"{type(e).__name__}: {e}", "server_error"))}
        yield {"data": "[DONE]"}

    return _EventStream(body(), gen.cancel, sep="\n", ping=15, headers={"Cache-Control": "no-cache"})


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

    # -- errors in OpenAI's shape --
    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(EdgeLLMError)
    async def _edgellm_error(request: Request, e: EdgeLLMError):
        status, kind, code = error_status(e)
        return JSONResponse(P.error_body(str(e), kind, None, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            why = (first.get("ctx") or {}).get("error", "JSON decode error")
            return JSONResponse(P.error_body(f"malformed JSON body: {why}", "invalid_request_error", None,
                                             "invalid_json"), status_code=400)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg')}"
                        for err in errs[:5])
        return JSONResponse(P.error_body(msg or "invalid request", "invalid_request_error",
                                         ".".join(loc) or None, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(P.error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("internal error")
        return JSONResponse(P.error_body(f"{type(e).__name__}: {e}", "server_error"), status_code=500)

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
    @app.post("/v1/chat/completions", dependencies=guarded, response_model=P.ChatCompletion,
              responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
    async def chat_completions(body: P.ChatCompletionRequest, request: Request, s: ServerState = Depends(ready)):
        _check_common(s, body)
        if body.tools:
            raise P.APIError(400, "tools are not supported by this server", param="tools")
        if body.top_logprobs is not None and not body.logprobs:
            raise P.APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
        prompt = await _tokenized(_chat_prompt, s, body.messages)
        ids, params = _params(s, body, [prompt], "messages", k)
        gen = Generation(s, ids, params)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": s.model_id}
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)

            async def chunks():
                for c in gen.choices:
                    yield _sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}],
                                **({"usage": None} if usage else {})})
                async for c, piece, n, finished in gen.events():
                    if not (piece or finished):
                        continue
                    lp = _chat_logprobs(s, c, n) if k is not None else None
                    c.sent = n
                    choice = {"index": c.index, "delta": {"content": piece} if piece else {}, "logprobs": lp,
                              "finish_reason": c.finish_reason if finished else None}
                    yield _sse({**head, "choices": [choice], **({"usage": None} if usage else {})})
                if usage:
                    yield _sse({**head, "choices": [], "usage": _usage(gen, [prompt])})

            return _stream_response(gen, chunks())
        await gen.collect(request)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.request.text},
                    "logprobs": _chat_logprobs(s, c, len(c.request.output_ids)) if k is not None else None,
                    "finish_reason": c.finish_reason} for c in gen.choices]
        return {"id": rid, "object": "chat.completion", "created": created, "model": s.model_id,
                "choices": choices, "usage": _usage(gen, [prompt]), "system_fingerprint": None}

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
