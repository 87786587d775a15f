"""/v1/chat/completions: a chat turn (edgellm.chat_turn) per choice, answered whole or as SSE deltas, with tool
calls (`tool_calls`, finish_reason "tool_calls") and reasoning (`reasoning_content`) split from the content."""
from __future__ import annotations

import time
import uuid

from fastapi import Depends, Request

from edgellm.server import protocol as P
from edgellm.server.helpers import (_chat_logprobs, _check_common, _params, _sse, _stream_response, _tokenized,
                                    _usage)
from edgellm.server.state import ERROR_RESPONSES, ServerState
from edgellm.server.generation import Generation


async def chat_turn(s: ServerState, messages: list[dict], options: dict):
    """The ChatTurn of a request, built in the thread pool (a tool grammar takes a while to compile); a bad tool
    specification is a 400 naming its field."""
    from edgellm.chat_turn import ChatTurn
    from edgellm.tool_prompt import ToolSpecError

    try:
        return await _tokenized(lambda: ChatTurn(s.llm, messages, **options))
    except ToolSpecError as e:
        raise P.APIError(400, str(e), param=e.param) from None


def turn_params(turn, params: list) -> list:
    """Each choice's SamplingParams with the turn's constraint; a conflict is a 400."""
    from edgellm.errors import InvalidRequestError

    try:
        return [turn.sampling(p) for p in params]
    except InvalidRequestError as e:
        raise P.APIError(400, str(e), param="tools") from None


def register(app, ready, guarded) -> None:
    """Add the route to app (ready: the dependency giving the ServerState; guarded: the auth dependencies)."""

    @app.post("/v1/chat/completions", dependencies=guarded, response_model=P.ChatCompletion,
              responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
    async def chat_completions(body: P.ChatCompletionRequest, request: Request, s: ServerState = Depends(ready)):
        _check_common(s, body)
        if body.top_logprobs is not None and not body.logprobs:
            raise P.APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
        turn = await chat_turn(s, P.message_dicts(body.messages), body.turn_options())
        prompt = await _tokenized(s.llm.prompt_ids, turn.prompt)
        ids, params = _params(s, body, [prompt], "messages", k)
        gen = Generation(s, ids, turn_params(turn, params))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": s.model_id}
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            extra = {"usage": None} if usage else {}
            streams = {c.index: turn.stream() for c in gen.choices}

            async def chunks():
                for c in gen.choices:
                    yield _sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}], **extra})
                async for c, piece, n, finished in gen.events():
                    if not (piece or finished):
                        continue
                    lp = _chat_logprobs(s, c, n) if k is not None else None
                    c.sent = n
                    st = streams[c.index]
                    deltas = st.feed(piece) + (st.finish() if finished else [])
                    if lp is not None and not deltas:
                        deltas = [{}]
                    reason = st.result(c.finish_reason).finish_reason if finished else None
                    for i, d in enumerate(deltas):
                        yield _sse({**head, "choices": [{"index": c.index, "delta": d, "logprobs": lp if i == 0 else None,
                                                         "finish_reason": None}], **extra})
                    if finished:
                        yield _sse({**head, "choices": [{"index": c.index, "delta": {}, "logprobs": None,
                                                         "finish_reason": reason}], **extra})
                if usage:
                    yield _sse({**head, "choices": [], "usage": _usage(gen, [prompt])})

            return _stream_response(gen, chunks())
        await gen.collect(request)
        choices = []
        for c in gen.choices:
            r = turn.result(c.request.text, c.finish_reason)
            choices.append({"index": c.index, "message": r.message(),
                            "logprobs": _chat_logprobs(s, c, len(c.request.output_ids)) if k is not None else None,
                            "finish_reason": r.finish_reason})
        return {"id": rid, "object": "chat.completion", "created": created, "model": s.model_id,
                "choices": choices, "usage": _usage(gen, [prompt]), "system_fingerprint": None}
