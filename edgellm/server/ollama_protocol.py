"""Ollama's API on the wire: request models (strict types, unknown fields ignored as Ollama does), response models
(they document the routes in /openapi.json), and the mapping of `options`, `format`, `think` and messages onto
SamplingParams and a chat turn.

Sampling defaults are Ollama's (temperature 0.8, top_k 40, top_p 0.9, min_p 0, repeat_penalty 1.1 over the last 64
tokens). `num_ctx` bounds the request's context (at most the loaded one: the model is not reloaded); a prompt that
does not fit is an error, never silently truncated as Ollama does; `num_predict` < 0 means "up to the context".
Options Ollama has for its runner (num_gpu, num_thread, mirostat, ...) are accepted and ignored, as is keep_alive
(the model stays loaded).
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from edgellm.sampling import SamplingParams
from edgellm.server.protocol import INT64, MAX_STOP


class OllamaError(Exception):
    """An error to return in Ollama's shape: {"error": message}."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class _Req(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Options(_Req):
    num_ctx: int | None = Field(None, ge=1)
    num_predict: int | None = Field(None, ge=-2)
    temperature: float | None = Field(None, ge=0, le=100)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0, le=100)
    repeat_last_n: int | None = Field(None, ge=-1)
    presence_penalty: float | None = Field(None, ge=-100, le=100)
    frequency_penalty: float | None = Field(None, ge=-100, le=100)
    seed: int | None = Field(None, **INT64)
    stop: list[str] | None = Field(None, max_length=MAX_STOP)


Format = Union[Literal["", "json"], dict[str, Any]]
Think = Union[bool, Literal["low", "medium", "high"]]
KeepAlive = Union[str, int, float]


class OllamaToolFunction(_Req):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(_Req):
    function: OllamaToolFunction


class Message(_Req):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class _Generate(_Req):
    model: str = Field(min_length=1)
    stream: bool = True
    options: Options | None = None
    format: Format | None = None
    keep_alive: KeepAlive | None = None
    think: Think | None = None


class ChatRequest(_Generate):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generate):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedRequest(_Req):
    model: str = Field(min_length=1)
    input: Union[str, list[str]]
    truncate: bool = True
    options: Options | None = None
    keep_alive: KeepAlive | None = None
    dimensions: int | None = Field(None, ge=1)


class EmbeddingsRequest(_Req):
    model: str = Field(min_length=1)
    prompt: str
    options: Options | None = None
    keep_alive: KeepAlive | None = None


class ShowRequest(_Req):
    model: str | None = None
    name: str | None = None  # older clients
    verbose: bool = False


# -- responses (documentation and schemathesis conformance) -------------------------------------------------------
class OllamaErrorResponse(BaseModel):
    """Every error under /api/: {"error": message} (the status line says which)."""
    error: str


class Version(BaseModel):
    version: str


class ModelDetails(BaseModel):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ModelEntry(BaseModel):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    modified_at: str


class OllamaModelList(BaseModel):
    models: list[ModelEntry]


class RunningModel(ModelEntry):
    expires_at: str
    size_vram: int
    context_length: int


class RunningList(BaseModel):
    models: list[RunningModel]


class ShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    license: str
    modified_at: str


class OllamaToolCallOut(BaseModel):
    function: OllamaToolFunction


class MessageOut(BaseModel):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[OllamaToolCallOut] | None = None


class _Done(BaseModel):
    """What a generation's last object carries (absent from the stream's other lines and from a load request's
    answer); durations in nanoseconds."""
    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatResponse(_Done):
    message: MessageOut


class GenerateResponse(_Done):
    response: str
    thinking: str | None = None
    context: list[int] | None = None


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class EmbeddingsResponse(BaseModel):
    embedding: list[float]


ERROR_RESPONSES = {code: {"model": OllamaErrorResponse} for code in (400, 401, 404, 429, 503)}
NDJSON = {"application/x-ndjson": {"schema": {
    "description": "stream (the default): one JSON object a line in the non-streamed answer's "
                                     "shape, the last with done: true and the timings; an error after the status "
                                     "line is a last line {\"error\": message}"}}}


def sampling(opts: Options | None, *, max_tokens: int, fmt) -> SamplingParams:
    """SamplingParams from Ollama's options (its defaults where absent) and format."""
    o = opts or Options()
    if o.stop is not None and not all(o.stop):
        raise OllamaError(400, "stop strings must be non-empty")
    kw: dict = {}
    if fmt == "json":
        kw["json_schema"] = True
    elif isinstance(fmt, dict):
        kw["json_schema"] = fmt
    t = 0.8 if o.temperature is None else o.temperature
    return SamplingParams(
        max_tokens=max_tokens, temperature=t if t >= 1e-5 else 0.0,
        top_k=40 if o.top_k is None else o.top_k, top_p=0.9 if o.top_p is None else max(o.top_p, 1e-9),
        min_p=o.min_p or 0.0, repeat_penalty=1.1 if o.repeat_penalty is None else o.repeat_penalty,
        repeat_last_n=64 if o.repeat_last_n is None else o.repeat_last_n,
        presence_penalty=o.presence_penalty or 0.0, frequency_penalty=o.frequency_penalty or 0.0,
        seed=None if o.seed is None or o.seed < 0 else o.seed % 2 ** 64, stop=list(o.stop or []), **kw)


def budget(opts: Options | None, n_prompt: int, max_len: int) -> int:
    """New tokens allowed: num_predict (negative: up to the context), bounded by the context; a prompt that
    leaves no room is an error."""
    o = opts or Options()
    ctx = min(o.num_ctx or max_len, max_len)
    if n_prompt == 0:
        raise OllamaError(400, "the prompt is empty")
    if n_prompt >= ctx:
        raise OllamaError(400, f"the prompt has {n_prompt} tokens but the context holds {ctx} (num_ctx, at most "
                               f"{max_len} here); shorten the prompt (edgellm never truncates it)")
    room = ctx - n_prompt
    return room if o.num_predict is None or o.num_predict < 0 else min(max(o.num_predict, 0), room)


def turn_options(think) -> tuple[dict, object]:
    """(chat-template variables, reasoning_effort) for Ollama's `think`."""
    if think is False:
        return {"enable_thinking": False}, None
    if isinstance(think, str):
        return {}, think
    return {}, None


def chat_messages(messages: list[Message]) -> list[dict]:
    """Ollama messages as the chat turn takes them (tool calls with ids, arguments as JSON text)."""
    out = []
    n_calls = 0
    for m in messages:
        if m.images:
            raise OllamaError(400, "this model takes no images")
        d: dict = {"role": m.role, "content": m.content or ""}
        if m.thinking:
            d["reasoning_content"] = m.thinking
        if m.tool_calls:
            d["tool_calls"] = [{"id": f"call_{n_calls + i}", "type": "function",
                                "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                               for i, c in enumerate(m.tool_calls)]
            n_calls += len(m.tool_calls)
        if m.role == "tool":
            d["tool_call_id"] = f"call_{max(n_calls - 1, 0)}"
            if m.tool_name:
                d["name"] = m.tool_name
        out.append(d)
    return out


def ollama_tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI tool_calls as Ollama writes them (arguments as an object)."""
    out = []
    for c in calls:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = {}
        out.append({"function": {"name": c["function"]["name"], "arguments": args if isinstance(args, dict) else {}}})
    return out
