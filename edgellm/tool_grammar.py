"""Grammars (llguidance Lark) that make a model's tool calls parse: the family's call syntax around JSON whose
arguments validate against each function's schema.

tool_choice "required" / a named function: the output is one call or more (one if parallel_tool_calls is false);
"auto": the model chooses text or calls. For families whose calls start with an opener ("<tool_call>",
"[TOOL_CALLS]") auto is text with calls anywhere after it, using llguidance's lazy lexemes (free text up to the opener,
then the call is constrained; trailing text may not contain the opener); for families whose calls are bare JSON
(Llama 3.x, generic) auto is text that does not start with "{" or "[", or calls. An opener that is a control token of
the vocabulary is written as `<[id]>` so the grammar produces that token, not its spelling.
"""
from __future__ import annotations

import json
import re

from edgellm import harmony
from edgellm.structured import JSON_DEFAULTS, compile_lark
from edgellm.tool_calls import ToolFamily
from edgellm.tool_prompt import ToolChoice, ToolSpecError


def arguments_schema(tool: dict) -> dict:
    """The JSON schema of `tool`'s arguments, closed: a constrained call says only what the schema names."""
    params = tool["function"]["parameters"]
    if params.get("type") == "object" and "properties" in params and "additionalProperties" not in params:
        params = {**params, "additionalProperties": False}
    return params


def call_schema(fam: ToolFamily, tool: dict) -> dict:
    """The JSON schema of one call object of `tool` in the family's keys (name first, then the arguments)."""
    return {"type": "object", "properties": {fam.name_key: {"const": tool["function"]["name"]},
                                             fam.args_key: arguments_schema(tool)},
            "required": [fam.name_key, fam.args_key], "additionalProperties": False}


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_DEFAULTS}, ensure_ascii=False)


def _marker(text: str, tokenizer) -> str:
    """A Lark item producing `text`: the control token if the vocabulary has it as one, else the literal."""
    tid = tokenizer.token_to_id(text) if tokenizer is not None else None
    if tid is not None and tokenizer.is_special(tid):
        return f"<[{tid}]>"
    return json.dumps(text, ensure_ascii=False)


def _not_containing(text: str) -> str:
    """A terminal body: any text that does not contain `text`."""
    r = re.escape(text).replace("/", "\\/")
    return f"/(?s:.*)/ & ~/(?s:.*){r}(?s:.*)/"


def tool_grammar(fam: ToolFamily, tools: list[dict], choice: ToolChoice, *, parallel: bool = True,
                 tokenizer=None) -> str | None:
    """The validated llguidance grammar for this tool_choice (None for "none", and harmony's "auto": nothing to
    constrain)."""
    if choice.mode == "none" or not tools:
        return None
    chosen = [t for t in tools if choice.name in (None, t["function"]["name"])]
    if fam.shape == "harmony":
        return _compiled(_harmony_rules(chosen, tokenizer)) if choice.mode == "required" else None
    one = {"anyOf": [call_schema(fam, t) for t in chosen]} if len(chosen) > 1 else call_schema(fam, chosen[0])
    rules = [f"obj: {_json(one)}"]
    opened = fam.shape in ("tagged", "array")
    op = _marker(fam.opener, tokenizer) if opened else None
    if fam.shape == "tagged":
        rules.append(f'rest: "\\n" obj "\\n" {_marker(fam.closer, tokenizer)}')
        rules.append(f"call: {op} rest")
        rules.append('calls: call ("\\n" call)*' if parallel else "calls: call")
        after_head = 'rest ("\\n" call)*' if parallel else "rest"
    elif fam.shape == "array":
        rules.append('rest: "[" obj ("," " " obj)* "]"' if parallel else 'rest: "[" obj "]"')
        rules.append(f"calls: {op} rest")
        after_head = "rest"
    elif fam.shape == "objects":
        rules.append('calls: obj (";" " " obj)*' if parallel else "calls: obj")
    else:
        arr = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        wrapped = {"type": "object", "properties": {fam.wrapper: arr}, "required": [fam.wrapper],
                   "additionalProperties": False}
        rules[0] = f"calls: {_json(wrapped)}"
    if choice.mode == "required":
        start = ["start: calls"]
    elif opened and not op.startswith("<["):
        # lazy text up to the first (literal) opener, then the call is constrained; else text without an opener
        lit = re.escape(fam.opener).replace("/", "\\/")
        start = [f"start: TEXT | head {after_head}", f"head[lazy]: /(?s:.*){lit}/",
                 f"TEXT: {_not_containing(fam.opener)}"]
    elif opened:  # a control-token opener: plain text can never produce it
        start = ["start: TEXT | TEXT calls", "TEXT: /(?s:.*)/"]
    else:
        start = ["start: TEXT | calls", r"TEXT: /([^{\[ \t\r\n](?s:.*))?/"]
    return _compiled(start + rules)


def _harmony_rules(tools: list[dict], tokenizer) -> list[str]:
    """One harmony call message to one of `tools` (see the module doc)."""
    ch, con, msg = (_marker(t, tokenizer) for t in (harmony.CHANNEL, harmony.CONSTRAIN, harmony.MESSAGE))
    rules = ["start: " + " | ".join(f"call{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        head = json.dumps(f"commentary to={harmony.FUNCTIONS}{t['function']['name']} ")
        rules.append(f'call{i}: {ch} {head} {con} "json" {msg} args{i}')
        rules.append(f"args{i}: {_json(arguments_schema(t))}")
    return rules


def _compiled(rules: list[str]) -> str:
    try:
        return compile_lark("\n".join(rules) + "\n")
    except Exception as e:  # a schema llguidance cannot compile: the request's tools are at fault
        raise ToolSpecError(f"cannot constrain tool calls to these tools: {e}") from None
