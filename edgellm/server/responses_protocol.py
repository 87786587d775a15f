"""OpenAI's Responses API (stateless) on the wire: the request model, its mapping onto a chat turn (input items ->
messages, flat function tools -> chat tools, text.format -> a JSON constraint, reasoning.effort -> the thinking
budget), and the output items and usage of a finished turn."""
from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal, Union

from pydantic import Field

from edgellm.server import protocol as P


class InputText(P._Request):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(P._Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputText]]


class FunctionCallItem(P._Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(P._Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(P._Request):
    type: Literal["reasoning"]
    content: list[dict[str, Any]] | None = None


InputItem = Union[InputMessage, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]


class FunctionTool(P._Request):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(P._Request):
    type: Literal["function"]
    name: str


class TextFormat(P._Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(P._Request):
    format: TextFormat | None = None


class ReasoningConfig(P._Request):
    effort: P.ReasoningEffort | None = None
    summary: str | None = None


class ResponsesRequest(P._Request):
    model: str | None = None
    input: Union[Annotated[str, Field(min_length=1)], Annotated[list[InputItem], Field(min_length=1)]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Union[Literal["auto", "none", "required"], NamedFunctionChoice, None] = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    seed: int | None = Field(None, **P.INT64)
    user: str | None = None
    metadata: dict[str, str] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def messages(req: ResponsesRequest) -> list[dict]:
    """The conversation of a request as chat messages (instructions first, function calls as assistant tool_calls,
    their outputs as tool messages)."""
    out: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for it in items:
        if isinstance(it, InputMessage):
            out.append({"role": "system" if it.role == "developer" else it.role, "content": _text(it.content)})
        elif isinstance(it, FunctionCallItem):
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(it, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": it.call_id, "content": it.output})
    if not any(m["role"] != "system" for m in out):
        raise P.APIError(400, "input must hold at least one message", param="input")
    return out


def turn_options(req: ResponsesRequest) -> dict:
    """ChatTurn keywords of a request."""
    tools = None
    if req.tools is not None:
        tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
                 for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
            "reasoning_effort": req.reasoning.effort if req.reasoning else None}


def response_format(req: ResponsesRequest) -> dict | None:
    """text.format as a chat response_format."""
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise P.APIError(400, "text.format json_schema needs a 'schema'", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def usage(n_prompt: int, n_output: int, n_cached: int) -> dict:
    return {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": n_cached, "cache_write_tokens": 0},
            "output_tokens": n_output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_prompt + n_output}


def envelope(req: ResponsesRequest, rid: str, created: int, model: str, *, status: str, output: list,
             usage_: dict | None, incomplete: bool = False) -> dict:
    """The response object around its output items."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": (req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump")
                            else req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": {"type": "text"}} if not (req.text and req.text.format) else
            {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)},
            "reasoning": {"effort": req.reasoning.effort} if req.reasoning else None,
            "store": False, "usage": usage_, "metadata": req.metadata or {}}
