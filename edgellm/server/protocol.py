"""OpenAI-compatible request and response models (pydantic), and their mapping onto SamplingParams.

Requests are strict about types (a string where a number belongs is a 400, not a silent cast) and ignore unknown
fields, as OpenAI's clients send new optional fields over time. Fields we accept but cannot honour (non-text
response formats, suffix, best_of != n) are rejected with a clear 400 rather than ignored.
Responses are built as plain dicts by the app; the response models here document them in /openapi.json.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from edgellm.errors import InvalidRequestError
from edgellm.sampling import MAX_LOGPROBS, SamplingParams

MAX_N = 16  # choices per request (each is one engine request)
MAX_STOP = 16
MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (dividing logits by ~0 would overflow to NaN)
INT64 = dict(ge=-(2 ** 63), le=2 ** 63 - 1)


class APIError(Exception):
    """An error to return in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


# -- sampling fields shared by both generation endpoints ----------------------------------------------------------
class _Sampling(_Request):
    model: str | None = Field(None, description="Model id from /v1/models (default: the served model).")
    max_tokens: int | None = Field(None, ge=1, description="Default: up to the end of the context.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy. Default 1.")
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 = off (default).")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100, description="llama.cpp repeat penalty; 1 = off.")
    seed: int | None = Field(None, **INT64)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    grammar: str | None = Field(None, description="llama.cpp-style constraint: a GBNF or Lark grammar.")
    json_schema: dict[str, Any] | None = Field(None, description="llama.cpp-style constraint: a JSON schema.")


# -- chat ---------------------------------------------------------------------------------------------------------
class TextPart(_Request):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Request):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="An assistant's earlier calls.")
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")
    reasoning_content: str | None = Field(None, description="An assistant's earlier reasoning.")


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments.")
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceType = Union[Literal["auto", "none", "required"], NamedToolChoice]
ReasoningEffort = Union[Literal["none", "minimal", "low", "medium", "high"], Annotated[int, Field(ge=0)]]


class _Tools(_Request):
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoiceType | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="Thinking budget of reasoning models: a level or a number of tokens.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra chat-template variables.")

    def turn_options(self) -> dict:
        """ChatTurn keywords of this request."""
        return {"tools": [t.model_dump(exclude_none=True) for t in self.tools] if self.tools is not None else None,
                "tool_choice": self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel)
                else self.tool_choice,
                "parallel_tool_calls": self.parallel_tool_calls, "reasoning_effort": self.reasoning_effort,
                "template_kwargs": self.chat_template_kwargs}


class ChatCompletionRequest(_Sampling, _Tools):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Takes precedence over max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None


# -- completions --------------------------------------------------------------------------------------------------
PromptType = Union[str, Annotated[list[str], Field(min_length=1)], Annotated[list[int], Field(min_length=1)],
                   Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]]


class CompletionRequest(_Sampling):
    prompt: PromptType
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


# -- tokenize -----------------------------------------------------------------------------------------------------
class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = Field(None, description="Text to tokenize (give this or messages).")
    messages: list[ChatMessage] | None = Field(None, min_length=1,
                                                description="A conversation, rendered with the chat template.")
    add_special_tokens: bool = Field(True, description="Add BOS as the model does (prompt only).")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- responses (documentation and schemathesis conformance) -------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: dict[str, int] | None = None  # speculative drafts: accepted/rejected_prediction_tokens


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: str


# -- request -> SamplingParams ------------------------------------------------------------------------------------
def max_new_tokens(req: _Sampling) -> int | None:
    mct = getattr(req, "max_completion_tokens", None)
    return mct if mct is not None else req.max_tokens


def constraint(req: _Sampling) -> tuple[dict, str | None]:
    """SamplingParams constraint keywords from response_format ({"type": "json_schema", "json_schema": {"schema":
    ...}} or {"type": "json_object"}) or llama.cpp's `grammar` / `json_schema` fields, and the field they came from."""
    found: list[tuple[dict, str]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            schema = rf.get("schema")  # llama.cpp also takes a schema here
            found.append(({"json_schema": schema if isinstance(schema, dict) else True}, "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise APIError(400, "response_format json_schema needs {'json_schema': {'schema': {...}}}",
                               param="response_format")
            found.append(({"json_schema": schema}, "response_format"))
        elif kind != "text":
            raise APIError(400, f"unsupported response_format type {kind!r} (text, json_object, json_schema)",
                           param="response_format")
    if req.grammar is not None:
        found.append(({"grammar": req.grammar}, "grammar"))
    if req.json_schema is not None:
        found.append(({"json_schema": req.json_schema}, "json_schema"))
    if len(found) > 1:
        raise APIError(400, "give only one of response_format (JSON), grammar, json_schema",
                       param=found[1][1])
    return found[0] if found else ({}, None)


def sampling_params(req: _Sampling, *, max_tokens: int, n_vocab: int, logprobs: int | None,
                    choice: int = 0) -> SamplingParams:
    """SamplingParams for one choice of a request. OpenAI defaults (temperature 1, top_p 1, no top-k / min-p)
    apply where a field is absent; with a seed, choice i draws from seed + i so n > 1 gives distinct choices."""
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= tok < n_vocab:
            raise APIError(400, f"logit_bias token id {tok} out of range [0, {n_vocab})", param="logit_bias")
        bias[tok] = value
    seed = None if req.seed is None else (req.seed + choice) % 2 ** 64  # numpy wants a non-negative seed
    temperature = 1.0 if req.temperature is None else req.temperature
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must be non-empty", param="stop")
    kw, param = constraint(req)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature if temperature >= MIN_TEMPERATURE else 0.0,
            top_k=max(req.top_k or 0, 0),
            top_p=1.0 if req.top_p is None else max(req.top_p, 1e-9),  # top_p 0 keeps only the top token
            min_p=req.min_p or 0.0,
            repeat_penalty=req.repetition_penalty or 1.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=seed, stop=stop, ignore_eos=req.ignore_eos, logit_bias=bias, logprobs=logprobs, **kw,
        )
    except InvalidRequestError as e:  # an invalid schema / grammar: 400 naming the field
        raise APIError(400, str(e), param=param) from None


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template expects them: role and string content (text parts joined), plus an
    assistant's tool_calls / reasoning_content and a tool message's tool_call_id / name when given."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if m.role == "developer" else m.role
        d = {"role": role, "content": content or ""}
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if getattr(m, key) is not None:
                d[key] = getattr(m, key)
        out.append(d)
    return out
