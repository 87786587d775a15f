"""Ollama's API on the same server: /api/chat, /api/generate, /api/embed (and the older /api/embeddings), /api/tags,
/api/show, /api/ps, /api/version. Streams are NDJSON (one JSON object a line, the last with "done": true and the
timings, in nanoseconds); errors are Ollama-shaped {"error": "..."} (the app's error handlers shape every /api/
path so). Chat goes through the same chat turn as /v1/chat/completions: tools, `think` (thinking -> "thinking"),
`format` (JSON or a schema) after the thinking."""
from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import datetime, timedelta, timezone

from fastapi import Depends, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from edgellm.server import ollama_protocol as OP
from edgellm.server.chat_routes import chat_turn, turn_params
from edgellm.server.embeddings import embeddings_of
from edgellm.server.generation import Generation
from edgellm.server.helpers import ClosingResponse, _tokenized
from edgellm.server.state import ServerState, error_status, log

VERSION = "0.12.0"  # the Ollama API version these routes follow (what /api/version reports)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def ollama_name(s: ServerState) -> str:
    """The served model's name as Ollama lists it (name:tag)."""
    return s.model_id if ":" in s.model_id else f"{s.model_id}:latest"


def check_model(s: ServerState, name: str | None) -> None:
    if name is None or name in s.aliases or name == ollama_name(s) or name.removesuffix(":latest") in s.aliases:
        return
    raise OP.OllamaError(404, f"model '{name}' not found")


def _details(s: ServerState) -> dict:
    meta, cfg = s.llm.loaded.metadata, s.llm.config
    import gguf

    ft = meta.get("general.file_type")
    try:
        quant = gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_").removeprefix("ALL_") if ft is not None else ""
    except ValueError:
        quant = str(ft)
    return {"parent_model": "", "format": "gguf", "family": cfg.arch, "families": [cfg.arch],
            "parameter_size": str(meta.get("general.size_label", "")), "quantization_level": quant}


def _entry(s: ServerState) -> dict:
    path = s.llm.loaded.path
    return {"name": ollama_name(s), "model": ollama_name(s), "size": os.path.getsize(path),
            "digest": hashlib.sha256(str(path).encode()).hexdigest(), "details": _details(s),
            "modified_at": datetime.fromtimestamp(os.path.getmtime(path), timezone.utc).isoformat()}


def _timings(gen: Generation, n_prompt: int) -> dict:
    m = gen.choices[0].request.metrics()
    ns = lambda t: int((t or 0) * 1e9)  # noqa: E731
    ttft = m["ttft_s"] or m["total_s"]
    return {"total_duration": ns(m["total_s"]), "load_duration": 0, "prompt_eval_count": n_prompt,
            "prompt_eval_duration": ns(ttft), "eval_count": m["completion_tokens"],
            "eval_duration": ns(max(m["total_s"] - ttft, 0))}


class _NDJSON(ClosingResponse, StreamingResponse):
    """NDJSON stream that cancels its generation however it ends."""

    def __init__(self, lines, on_close):
        super().__init__(lines, media_type="application/x-ndjson")
        self._on_close = on_close


def _ndjson(gen: Generation, objects) -> _NDJSON:
    async def lines():
        try:
            async for obj in objects:
                yield json.dumps(obj, ensure_ascii=False) + "\n"
        except Exception as e:  # the status line is gone: report in the stream (the client raises it)
            if error_status(e)[0] >= 500:
                log.exception("ollama stream failed")
            yield json.dumps({"error": str(e) or type(e).__name__}) + "\n"

    return _NDJSON(lines(), gen.cancel)


async def _run(s: ServerState, body, request: Request, turn, prompt_ids: list[int], kind: str, extra_done=None):
    """Generate one answer and reply in Ollama's shape: kind "chat" (message) or "generate" (response)."""
    check = OP.budget(body.options, len(prompt_ids), s.max_len)
    params = OP.sampling(body.options, max_tokens=check, fmt=body.format or None)
    params = turn_params(turn, [params])[0] if turn is not None else params
    gen = Generation(s, [prompt_ids], [params])
    head = {"model": body.model, "created_at": _now()}
    stream = turn.stream() if turn is not None else None

    def piece_obj(deltas: list[dict], done: bool) -> dict | None:
        text = "".join(d.get("content", "") for d in deltas)
        thought = "".join(d.get("reasoning_content", "") for d in deltas)
        if not (text or thought) and not done:
            return None
        if kind == "chat":
            msg = {"role": "assistant", "content": text, **({"thinking": thought} if thought else {})}
            return {**head, "created_at": _now(), "message": msg, "done": False}
        return {**head, "created_at": _now(), "response": text, **({"thinking": thought} if thought else {}),
                "done": False}

    def final(text: str | None, thought: str | None, calls: list[dict], reason: str | None) -> dict:
        reason = "stop" if reason == "tool_calls" else reason
        out = {**head, "created_at": _now()}
        if kind == "chat":
            msg = {"role": "assistant", "content": text or ""}
            if thought:
                msg["thinking"] = thought
            if calls:
                msg["tool_calls"] = OP.ollama_tool_calls(calls)
            out["message"] = msg
        else:
            out["response"] = text or ""
            if thought:
                out["thinking"] = thought
            if extra_done is not None:
                out["context"] = extra_done(gen)
        return {**out, "done": True, "done_reason": reason, **_timings(gen, len(prompt_ids))}

    if body.stream:
        async def objects():
            async for c, piece, n, finished in gen.events():
                if stream is None:
                    obj = piece_obj([{"content": piece}], False) if piece else None
                    if obj:
                        yield obj
                    if finished:
                        yield final("", None, [], c.finish_reason)
                    continue
                deltas = stream.feed(piece) + (stream.finish() if finished else [])
                obj = piece_obj(deltas, False)
                if obj:
                    yield obj
                if finished:
                    r = stream.result(c.finish_reason)
                    yield final("", None, r.tool_calls, r.finish_reason)

        return _ndjson(gen, objects())
    await gen.collect(request)
    c = gen.choices[0]
    if turn is None:
        return final(c.request.text, None, [], c.finish_reason)
    r = turn.result(c.request.text, c.finish_reason)
    return final(r.content, r.reasoning_content, r.tool_calls, r.finish_reason)


def register(app, ready, guarded, *, root: bool = True) -> None:
    """Add Ollama's routes to app; root: also its liveness answer at / (left to the web UI's chat page when that
    is served)."""
    if root:
        @app.get("/", response_class=PlainTextResponse, include_in_schema=False)
        async def ollama_root():
            return "Ollama is running"

    doc = dict(dependencies=guarded, responses=OP.ERROR_RESPONSES, response_model_exclude_unset=True)
    streamed = {**OP.ERROR_RESPONSES, 200: {"content": OP.NDJSON}}

    @app.get("/api/version", response_model=OP.Version, **doc)
    async def version():
        """The Ollama API version these routes follow."""
        return {"version": VERSION}

    @app.get("/api/tags", response_model=OP.OllamaModelList, **doc)
    async def tags(s: ServerState = Depends(ready)):
        """The served model (Ollama's model list)."""
        return {"models": [_entry(s)]}

    @app.get("/api/ps", response_model=OP.RunningList, **doc)
    async def ps(s: ServerState = Depends(ready)):
        """The loaded model: loaded until the server stops, its context length."""
        expires = (datetime.now(timezone.utc) + timedelta(days=365)).isoformat()  # loaded until the server stops
        return {"models": [{**_entry(s), "expires_at": expires, "size_vram": 0, "context_length": s.max_len}]}

    @app.post("/api/show", response_model=OP.ShowResponse, **doc)
    async def show(body: OP.ShowRequest, s: ServerState = Depends(ready)):
        """The model's details, GGUF metadata (model_info), chat template and capabilities."""
        name = body.model or body.name
        if not name:
            raise OP.OllamaError(400, "model is required")
        check_model(s, name)
        llm = s.llm
        meta = llm.loaded.metadata
        info = {k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool))
                and not k.startswith("tokenizer.chat_template")}
        tpl = llm.chat_template
        caps = ["completion", "tools", "embedding"] + (["thinking"] if "<think>" in tpl.source else [])
        return {"modelfile": f"FROM {llm.loaded.path}\n", "parameters": "", "template": tpl.source,
                "details": _details(s), "model_info": info, "capabilities": caps, "license": "",
                "modified_at": _entry(s)["modified_at"]}

    @app.post("/api/chat", response_model=OP.ChatResponse, **{**doc, "responses": streamed})
    async def chat(body: OP.ChatRequest, request: Request, s: ServerState = Depends(ready)):
        """A chat turn (tools, think, format after the thinking); NDJSON unless stream is false; a prompt beyond
        num_ctx is a 400."""
        check_model(s, body.model)
        if not body.messages:  # Ollama's "load the model" request
            return {"model": body.model, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                    "done": True, "done_reason": "load"}
        kw, effort = OP.turn_options(body.think)
        turn = await chat_turn(s, OP.chat_messages(body.messages), {
            "tools": body.tools, "reasoning_effort": effort, "template_kwargs": kw})
        ids = await _tokenized(s.llm.prompt_ids, turn.prompt)
        return await _run(s, body, request, turn, ids, "chat")

    @app.post("/api/generate", response_model=OP.GenerateResponse, **{**doc, "responses": streamed})
    async def generate(body: OP.GenerateRequest, request: Request, s: ServerState = Depends(ready)):
        """A completion of prompt (in the chat template unless raw), continuing context if given; NDJSON unless
        stream is false."""
        check_model(s, body.model)
        if body.suffix:
            raise OP.OllamaError(400, "suffix (fill-in-the-middle) is not supported")
        if body.template:
            raise OP.OllamaError(400, "a custom template is not supported; send raw=true with a rendered prompt")
        if body.images:
            raise OP.OllamaError(400, "this model takes no images")
        if not body.prompt and not body.context:  # Ollama's "load the model" request
            return {"model": body.model, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
        turn = None
        if body.raw:
            ids = await _tokenized(s.llm.prompt_ids, body.prompt or "")
        else:
            msgs = ([{"role": "system", "content": body.system}] if body.system else []) + \
                   [{"role": "user", "content": body.prompt or ""}]
            kw, effort = OP.turn_options(body.think)
            turn = await chat_turn(s, msgs, {"reasoning_effort": effort, "template_kwargs": kw})
            ids = await _tokenized(s.llm.prompt_ids, turn.prompt)
        if body.context:
            bad = [t for t in body.context if not 0 <= t < s.llm.config.n_vocab]
            if bad:
                raise OP.OllamaError(400, f"context token id {bad[0]} out of range")
            ids = list(body.context) + [t for t in ids if t != s.llm.tokenizer.bos_id]
        prompt = list(ids)
        return await _run(s, body, request, turn, ids, "generate",
                          extra_done=lambda g: prompt + list(g.choices[0].request.output_ids))

    @app.post("/api/embed", response_model=OP.EmbedResponse, **doc)
    async def embed(body: OP.EmbedRequest, s: ServerState = Depends(ready)):
        """L2-normalised embeddings of the inputs, one batch."""
        check_model(s, body.model)
        t0 = time.perf_counter()
        items = [body.input] if isinstance(body.input, str) else body.input
        if not items or not all(items):
            raise OP.OllamaError(400, "input must be a non-empty string or list of non-empty strings")
        ids = await _tokenized(lambda: [s.llm.prompt_ids(x) for x in items])
        vecs = await _tokenized(embeddings_of, s, ids, body.dimensions)
        return {"model": body.model, "embeddings": vecs.tolist(), "total_duration": int((time.perf_counter() - t0) * 1e9),
                "load_duration": 0, "prompt_eval_count": sum(len(x) for x in ids)}

    @app.post("/api/embeddings", response_model=OP.EmbeddingsResponse, **doc)
    async def embeddings(body: OP.EmbeddingsRequest, s: ServerState = Depends(ready)):
        """The older single-prompt embedding route."""
        check_model(s, body.model)
        if not body.prompt:
            return {"embedding": []}
        ids = await _tokenized(s.llm.prompt_ids, body.prompt)
        return {"embedding": (await _tokenized(embeddings_of, s, [ids], None))[0].tolist()}
