"""/v1/responses (stateless): a chat turn answered as Response output items (reasoning, message, function calls),
whole or as the API's SSE events (response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta / .done, response.function_call_arguments.delta / .done,
response.reasoning_text.delta / .done, response.output_item.done, response.completed or response.incomplete)."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

from fastapi import Depends, Request

from edgellm.errors import EdgeLLMError, InvalidRequestError
from edgellm.sampling import SamplingParams
from edgellm.server import protocol as P
from edgellm.server import responses_protocol as RP
from edgellm.server.chat_routes import chat_turn, turn_params
from edgellm.server.generation import Generation
from edgellm.server.helpers import _EventStream, _budget, _check_common, _tokenized
from edgellm.server.state import ERROR_RESPONSES, ServerState, error_status, log


class EventWriter:
    """Chat deltas -> Responses stream events; keeps the output items as they grow (one open at a time)."""

    def __init__(self):
        self.seq = 0
        self.items: list[dict] = []
        self.open: str | None = None  # kind of the open (last) item: "reasoning", "message" or "function_call"

    def _ev(self, kind: str, **kw) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **kw}

    def _start(self, kind: str, item: dict) -> list[dict]:
        out = self.close()
        self.items.append(item)
        self.open = kind
        i = len(self.items) - 1
        out.append(self._ev("response.output_item.added", output_index=i, item={**item, "status": "in_progress"}))
        if kind == "message":
            out.append(self._ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def feed(self, delta: dict) -> list[dict]:
        out: list[dict] = []
        if delta.get("reasoning_content"):
            if self.open != "reasoning":
                out += self._start("reasoning", RP.reasoning_item(RP.new_id("rs"), "", "completed"))
            item = self.items[-1]
            item["content"][0]["text"] += delta["reasoning_content"]
            out.append(self._ev("response.reasoning_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                                content_index=0, delta=delta["reasoning_content"]))
        if delta.get("content"):
            if self.open != "message":
                out += self._start("message", RP.message_item(RP.new_id("msg"), "", "completed"))
            item = self.items[-1]
            item["content"][0]["text"] += delta["content"]
            out.append(self._ev("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                                content_index=0, delta=delta["content"], logprobs=[]))
        for tc in delta.get("tool_calls", []):
            if "id" in tc:
                out += self._start("function_call", RP.call_item(RP.new_id("fc"), tc["id"], tc["function"]["name"],
                                                                 "", "completed"))
            item, args = self.items[-1], tc["function"]["arguments"]
            if args:
                item["arguments"] += args
                out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=len(self.items) - 1, delta=args))
        return out

    def close(self) -> list[dict]:
        """The done events of the open item."""
        if self.open is None:
            return []
        item, i, out = self.items[-1], len(self.items) - 1, []
        if self.open == "reasoning":
            out.append(self._ev("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                                text=item["content"][0]["text"]))
        elif self.open == "message":
            part = item["content"][0]
            out.append(self._ev("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                text=part["text"], logprobs=[]))
            out.append(self._ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                part=part))
        else:
            out.append(self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                name=item["name"], arguments=item["arguments"]))
        out.append(self._ev("response.output_item.done", output_index=i, item=item))
        self.open = None
        return out


def _items(result) -> list[dict]:
    """Output items of a finished turn (the same as streaming it through EventWriter)."""
    w = EventWriter()
    if result.reasoning_content:
        w.feed({"reasoning_content": result.reasoning_content})
    if result.content:
        w.feed({"content": result.content})
    for c in result.tool_calls:
        w.feed({"tool_calls": [{"id": c["id"], "function": c["function"]}]})
    return w.items


def _params(s: ServerState, body: RP.ResponsesRequest, prompt: list[int], turn) -> SamplingParams:
    max_tokens = _budget(s, SimpleNamespace(max_tokens=body.max_output_tokens), [prompt], "input")
    kw = P.constraint(SimpleNamespace(response_format=RP.response_format(body), grammar=None, json_schema=None))[0]
    t = 1.0 if body.temperature is None else body.temperature
    try:
        p = SamplingParams(max_tokens=max_tokens, temperature=t if t >= P.MIN_TEMPERATURE else 0.0, top_k=0,
                           top_p=1.0 if body.top_p is None else max(body.top_p, 1e-9), min_p=0.0,
                           seed=None if body.seed is None else body.seed % 2 ** 64, **kw)
    except InvalidRequestError as e:
        raise P.APIError(400, str(e), param="text.format") from None
    return turn_params(turn, [p])[0]


def register(app, ready, guarded) -> None:
    """Add the route to app."""

    @app.post("/v1/responses", dependencies=guarded, responses={**ERROR_RESPONSES,
                                                                200: {"content": {"text/event-stream": {}}}})
    async def responses(body: RP.ResponsesRequest, request: Request, s: ServerState = Depends(ready)):
        _check_common(s, body)
        if body.previous_response_id:
            raise P.APIError(400, "responses are not stored (stateless server): send the whole conversation as "
                                  "input instead of previous_response_id", param="previous_response_id")
        turn = await chat_turn(s, RP.messages(body), RP.turn_options(body))
        prompt = await _tokenized(s.llm.prompt_ids, turn.prompt)
        gen = Generation(s, [prompt], [_params(s, body, prompt, turn)])
        rid, created = RP.new_id("resp"), int(time.time())

        def envelope(status: str, output: list, done: bool) -> dict:
            c = gen.choices[0]
            use = RP.usage(len(prompt), len(c.request.output_ids), c.request.n_cached) if done else None
            return RP.envelope(body, rid, created, s.model_id, status=status, output=output, usage_=use,
                               incomplete=status == "incomplete")

        if body.stream:
            w, st = EventWriter(), turn.stream()

            async def events():
                yield w._ev("response.created", response=envelope("in_progress", [], False))
                yield w._ev("response.in_progress", response=envelope("in_progress", [], False))
                async for c, piece, n, finished in gen.events():
                    for d in st.feed(piece) + (st.finish() if finished else []):
                        for e in w.feed(d):
                            yield e
                    if finished:
                        for e in w.close():
                            yield e
                        status = "incomplete" if c.finish_reason == "length" else "completed"
                        yield w._ev(f"response.{status}", response=envelope(status, w.items, True))

            async def sse():
                try:
                    async for e in events():
                        yield {"event": e["type"], "data": json.dumps(e, ensure_ascii=False)}
                except Exception as e:  # the status line is gone: an error event ends the stream
                    status, kind, code = error_status(e) if isinstance(e, EdgeLLMError) else (500, "server_error",
                                                                                              None)
                    if status >= 500:
                        log.exception("responses stream failed")
                    err = w._ev("error", code=code or kind, message=str(e) or type(e).__name__, param=None)
                    yield {"event": "error", "data": json.dumps(err)}

            return _EventStream(sse(), gen.cancel, sep="\n", ping=15, headers={"Cache-Control": "no-cache"})
        await gen.collect(request)
        c = gen.choices[0]
        r = turn.result(c.request.text, c.finish_reason)
        return envelope("incomplete" if c.finish_reason == "length" else "completed", _items(r), True)
