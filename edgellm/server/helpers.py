"""Helpers of the OpenAI routes: prompts and sampling parameters from a request, the context budget, logprobs,
usage, and SSE streaming that cancels its generation however the response ends."""
from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from edgellm.errors import EdgeLLMError
from edgellm.server import protocol as P
from edgellm.server.generation import Choice, Generation
from edgellm.server.state import ServerState, error_status

log = logging.getLogger("edgellm.server")


def error_reply(request, body: dict, status_code: int, headers: dict | None = None):
    """An error response: OpenAI's shape, or Ollama's {"error": message} on its /api/ routes."""
    from fastapi.responses import JSONResponse

    if request.url.path.startswith("/api/"):
        body = {"error": body["error"]["message"]}
    return JSONResponse(body, status_code=status_code, headers=headers)


# -- building prompts and parameters -------------------------------------------------------------------------
def _chat_prompt(state: ServerState, messages) -> list[int]:
    from edgellm.chat_turn import ChatTurn

    return state.llm.prompt_ids(ChatTurn(state.llm, P.message_dicts(messages)).prompt)


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
    """OpenAI's usage; with speculative drafts, their accepted / rejected tokens under OpenAI's names of
    predicted-output tokens."""
    p = sum(len(x) for x in prompts)
    g = sum(len(c.request.output_ids) for c in gen.choices)
    out = {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}
    drafted = sum(c.request.n_drafted for c in gen.choices)
    if drafted:
        accepted = sum(c.request.n_accepted for c in gen.choices)
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


def _card(s: ServerState) -> dict:
    return {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "edgellm",
            "max_model_len": s.max_len}


def _sse(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ClosingResponse:
    """Mixin for a streaming response: `self._on_close()` runs however the response ends (even if the client left
    before the body started), so its generation is cancelled."""

    _on_close = staticmethod(lambda: None)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _EventStream(ClosingResponse, EventSourceResponse):
    """SSE response that cancels its generation however it ends."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close


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


