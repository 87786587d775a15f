"""Tools on the prompt side: OpenAI `tools` / `tool_choice` validated, and a conversation with tool calls and tool
results prepared for the model's chat template.

A template that reads the `tools` variable (Qwen, Hermes, Llama 3.x, Mistral, ...) gets the tools and the history as
transformers passes them (assistant `tool_calls` with their arguments as objects, `tool` messages with their
`tool_call_id`), as llama.cpp's --jinja does (gpt-oss's harmony template renders one call per assistant message and
names a tool result by the call before it: each call becomes its own message, followed by its result, and the
reasoning of a call's turn its `thinking`; it also writes every tool's description, so one without gets ""). A
template that knows nothing of tools (Gemma, Phi-3, a base model's) gets the generic rendering, as llama.cpp's
generic handler does: the tools and the answer format (`{"tool_calls": [{"name", "arguments"}]}`) in the system
message, past calls as that JSON in the assistant's turn, tool results as user turns, and consecutive turns of one
role merged (such templates insist on alternation).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from edgellm.errors import InvalidRequestError
from edgellm.tool_calls import GENERIC, ToolFamily

NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names (plus dots)
GENERIC_SYSTEM = (
    "You can call the following tools. Each is given as a JSON object with its name, description and the JSON "
    "schema of its arguments:\n{tools}\n\nTo call tools, reply with only a JSON object of the form "
    '{{"tool_calls": [{{"name": <tool name>, "arguments": <arguments object>}}]}}. Otherwise, reply normally.'
)


class ToolSpecError(InvalidRequestError):
    """A malformed `tools` / `tool_choice` (param names the request field)."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """What the model may do: mode "auto" (text or calls), "none" (text only), "required" (one call or more);
    `name` restricts calls to one function (a named tool_choice, mode "required")."""

    mode: str = "auto"
    name: str | None = None


def check_tools(tools) -> list[dict]:
    """The tools as OpenAI function tools [{"type": "function", "function": {"name", "description", "parameters"}}],
    checked (names unique and well formed, parameters a JSON-schema object). Raises ToolSpecError."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolSpecError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolSpecError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ToolSpecError(f"tools[{i}].function.name must match {NAME_RE.pattern}")
        if name in seen:
            raise ToolSpecError(f"tools[{i}]: function {name!r} is given twice")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolSpecError(f"tools[{i}].function.parameters must be a JSON schema object")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolSpecError(f"tools[{i}].function.description must be a string")
        f = {"name": name, **({"description": desc} if desc is not None else {}), "parameters": params}
        out.append({"type": "function", "function": f})
    return out


def check_choice(choice, tools: list[dict]) -> ToolChoice:
    """tool_choice ("auto" | "none" | "required" | {"type": "function", "function": {"name"}}) checked against the
    tools. Without tools only "none" / "auto" make sense (both mean text). Raises ToolSpecError."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ToolSpecError("tool_choice must be 'auto', 'none', 'required' or a named function", "tool_choice")
        if choice == "required" and not tools:
            raise ToolSpecError("tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(choice if tools else "none")
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolSpecError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolSpecError(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
    return ToolChoice("required", name)


def _arguments(value):
    """Arguments as templates expect them (an object); text that is not JSON stays text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _short_id(call_id, n: int) -> str:
    """A call id of exactly n alphanumeric characters (Mistral's templates refuse others), stable per id."""
    s = str(call_id or "")
    return s if len(s) == n and s.isalnum() else hashlib.sha1(s.encode()).hexdigest()[:n]


def native_messages(messages: list[dict], fam: ToolFamily) -> list[dict]:
    """Messages for a tool-aware template: tool_calls' arguments as objects, ids in the family's style."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                fn["arguments"] = _arguments(fn.get("arguments", {}))
                c = {**c, "function": fn}
                if fam.id_length:
                    c["id"] = _short_id(c.get("id"), fam.id_length)
                calls.append(c)
            m["tool_calls"] = calls
        if fam.id_length and m.get("role") == "tool":
            m["tool_call_id"] = _short_id(m.get("tool_call_id"), fam.id_length)
        out.append(m)
    return HISTORY[fam.shape](out) if fam.shape in HISTORY else out


def _harmony_history(messages: list[dict]) -> list[dict]:
    """Messages for gpt-oss's template (see the module doc)."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        i += 1
        calls = m.get("tool_calls") or []
        if m.get("role") != "assistant" or not calls:
            out.append(m)
            continue
        if m.get("reasoning_content") and not m.get("content"):
            m = {**m, "thinking": m["reasoning_content"]}
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        used: list[int] = []
        for k, call in enumerate(calls):
            out.append({**(m if k == 0 else {"role": "assistant", "content": ""}), "tool_calls": [call]})
            ids = [j for j, r in enumerate(results) if r.get("tool_call_id") == call.get("id")] or [k]
            j = next((j for j in ids if j < len(results) and j not in used), None)  # by id, else by position
            if j is not None:
                used.append(j)
                out.append(results[j])
        out += [r for j, r in enumerate(results) if j not in used]
    return out


def native_tools(tools: list[dict], fam: ToolFamily) -> list[dict]:
    """The tools as the family's template reads them (gpt-oss's writes every function's description)."""
    return TOOL_SHAPES[fam.shape](tools) if fam.shape in TOOL_SHAPES else tools


def _described(tools: list[dict]) -> list[dict]:
    return [{**t, "function": {"description": "", **t["function"]}} for t in tools]


HISTORY = {"harmony": _harmony_history}  # families whose templates want the history reshaped
TOOL_SHAPES = {"harmony": _described}  # families whose templates want more of each tool than OpenAI requires


def generic_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages for a template without tool support (see the module doc)."""
    out: list[dict] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if m.get("tool_calls"):
            calls = [{GENERIC.name_key: (c.get("function") or {}).get("name"),
                      GENERIC.args_key: _arguments((c.get("function") or {}).get("arguments", {}))}
                     for c in m["tool_calls"]]
            text = json.dumps({GENERIC.wrapper: calls}, ensure_ascii=False)
            content = f"{content}\n{text}" if content else text
        if role == "tool":
            role = "user"
            result = {"tool_call_id": m.get("tool_call_id"), "content": content}
            if m.get("name"):
                result["name"] = m["name"]
            content = json.dumps({"tool_response": result}, ensure_ascii=False)
        if out and out[-1]["role"] == role:
            out[-1]["content"] += "\n\n" + content
        else:
            out.append({"role": role, "content": content})
    if tools:
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        text = GENERIC_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def has_tool_history(messages: list[dict]) -> bool:
    """Whether a conversation holds tool calls or tool results."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
