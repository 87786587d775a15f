"""Tool calls in a model's own syntax: the families as data, and a parser of the model's output that works on a
partial text too, so streamed deltas and the final answer come from one function.

A family says how its models write calls (`ToolFamily`): Hermes 2/3, Qwen2.5 and Qwen3 put one JSON object per
``<tool_call>...</tool_call>``; Llama 3.1-3.3 answer with a bare JSON object ``{"name", "parameters"}`` (or
``<|python_tag|>`` then the object, or a built-in ``tool.call(k="v")``); Mistral writes ``[TOOL_CALLS]`` then a JSON
array of calls; the generic format (models whose template knows no tools, see tool_prompt.py) is one JSON object
``{"tool_calls": [{"name", "arguments"}, ...]}``; gpt-oss writes harmony messages addressed ``to=functions.NAME``
(edgellm/harmony.py reads them, from the whole output: its calls follow the analysis channel). The family is read
off the chat template's text (`FAMILIES`, in order; `family_for_template`).

`parse(text, family, final=)` splits an output into content and calls. On a partial text (final=False) it holds
back what may still turn into a call (a prefix of the opener, a JSON object that has not closed yet, trailing
whitespace), and each call's arguments are the raw JSON text generated so far, so every later parse extends what an
earlier one returned: `ToolCallStream` sends the differences as OpenAI `delta.tool_calls` (index per call, id and name
once, arguments in pieces) and its final parse equals the non-streamed answer.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Callable

from edgellm import harmony

_WS = " \t\r\n"


@dataclass(frozen=True)
class ToolFamily:
    """How one family of models writes tool calls.

    shape: "tagged" (opener, one object, closer; repeated anywhere), "array" (opener or bare start, then a JSON array
    of call objects), "objects" (opener or bare start, then call objects separated by ';'), "wrapped" (a bare JSON
    object whose `wrapper` key holds the array of calls), "harmony" (messages addressed to a function, one call
    each). bare: a call section may also start the message without the opener, at its first non-blank character
    (the opener is often a control token the text does not show). whole_output: the parser reads the whole output,
    reasoning included (it splits the reasoning off itself); else it reads the answer after the reasoning."""

    name: str
    markers: tuple[str, ...]  # any of these in a chat template's text selects the family
    shape: str
    opener: str | None = None
    closer: str | None = None
    bare: bool = False
    name_key: str = "name"
    args_keys: tuple[str, ...] = ("arguments",)
    wrapper: str | None = None
    id_length: int | None = None  # Mistral's templates want 9 alphanumeric characters; None: "call_" + 24 hex
    whole_output: bool = False

    @property
    def args_key(self) -> str:
        """The key the family's constrained output uses for the arguments."""
        return self.args_keys[0]

    def new_id(self) -> str:
        """A fresh tool-call id in the family's style."""
        if self.id_length:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(self.id_length))
        return "call_" + secrets.token_hex(12)


FAMILIES: dict[str, ToolFamily] = {
    f.name: f for f in (
        ToolFamily("harmony", ("<|call|>",), "harmony", whole_output=True),
        ToolFamily("hermes", ("<tool_call>",), "tagged", opener="<tool_call>", closer="</tool_call>"),
        ToolFamily("mistral", ("[TOOL_CALLS]",), "array", opener="[TOOL_CALLS]", bare=True, id_length=9),
        ToolFamily("llama3", ("<|python_tag|>", '"parameters": '), "objects", opener="<|python_tag|>", bare=True,
                   args_keys=("parameters", "arguments")),
        ToolFamily("generic", (), "wrapped", bare=True, wrapper="tool_calls"),
    )
}
GENERIC = FAMILIES["generic"]


def family_for_template(source: str | None) -> ToolFamily:
    """The family whose markers appear in a chat template's text (the generic JSON format if none does)."""
    text = source or ""
    return next((f for f in FAMILIES.values() if any(m in text for m in f.markers)), GENERIC)


@dataclass
class ParsedCall:
    """One call as parsed so far: name None until its string has closed; arguments is raw JSON text (a prefix of
    the final text while the call is still open)."""

    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class Parsed:
    """An output split into content (text outside calls) and calls."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


# -- a JSON scanner that tells "complete" from "not finished yet" -------------------------------------------------
class _Invalid(Exception):
    pass


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _scan(s: str, i: int) -> int | None:
    """End index of the JSON value starting at s[i], or None if the text ends inside it. Raises _Invalid on text
    that cannot start or continue a JSON value (brackets are balanced, not fully validated: json.loads does that)."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        j = i + 1
        while j < len(s):
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < len(s):
            ch = s[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = re.compile(r"-?[0-9.eE+\-]+|true|false|null").match(s, i)
    if m is None:
        if any(w.startswith(s[i:]) for w in ("true", "false", "null")):
            return None
        raise _Invalid
    return None if m.end() == len(s) else m.end()


def _call_object(s: str, i: int, fam: ToolFamily) -> tuple[int | None, ParsedCall | None]:
    """Parse the call object starting at s[i] == '{': (end or None if unfinished, the call or None if the object
    is not a call: complete without a name). Raises _Invalid."""
    call, j, have_name = ParsedCall(), i + 1, False
    while True:
        j = _ws(s, j)
        if j >= len(s):
            return None, call
        if s[j] == "}":
            if not have_name:
                return j + 1, None
            call.done = True
            call.arguments = call.arguments or "{}"
            return j + 1, call
        if s[j] == ",":
            j += 1
            continue
        if s[j] != '"':
            raise _Invalid
        kend = _scan(s, j)
        if kend is None:
            return None, call
        key = json.loads(s[j:kend])
        j = _ws(s, kend)
        if j >= len(s):
            return None, call
        if s[j] != ":":
            raise _Invalid
        j = _ws(s, j + 1)
        vend = _scan(s, j)
        if key == fam.name_key:
            if vend is not None:
                name = json.loads(s[j:vend])
                if not isinstance(name, str):
                    raise _Invalid
                call.name, have_name = name, True
        elif key in fam.args_keys:
            call.arguments = s[j:] if vend is None else s[j:vend]
        if vend is None:
            return None, call
        j = vend


def _call_list(s: str, i: int, fam: ToolFamily, *, sep: str, close: str | None) -> tuple[int | None, list]:
    """Call objects from s[i] separated by `sep` characters (or blanks), until `close` (None: the first thing that
    is not a call object). Returns (end or None if unfinished, calls)."""
    calls: list[ParsedCall] = []
    j = i
    while True:
        j = _ws(s, j)
        if j >= len(s):
            return None, calls
        if close is not None and s[j] == close:
            return j + 1, calls
        if s[j] in sep and calls:
            j += 1
            continue
        if s[j] != "{":
            if close is None and calls:
                return j, calls
            raise _Invalid
        end, call = _call_object(s, j, fam)
        if call is None:
            raise _Invalid
        calls.append(call)
        if end is None:
            return None, calls
        j = end


_PYTHON_CALL = re.compile(r"([A-Za-z_][\w.]*)\.call\((.*)\)\s*$", re.S)
_PY_ARG = re.compile(r'\s*(\w+)\s*=\s*("(?:[^"\\]|\\.)*"|[^,]+)\s*(?:,|$)')


def _python_call(s: str, i: int) -> tuple[int | None, list]:
    """Llama 3.1's built-in tool syntax after <|python_tag|>: name.call(key="value", ...), as one complete call."""
    m = _PYTHON_CALL.match(s, _ws(s, i))
    if m is None:
        return None, []
    args = {}
    for a in _PY_ARG.finditer(m.group(2)):
        v = a.group(2).strip()
        try:
            args[a.group(1)] = json.loads(v)
        except ValueError:
            args[a.group(1)] = v
    return len(s), [ParsedCall(m.group(1), json.dumps(args, ensure_ascii=False), True)]


def _section(s: str, i: int, fam: ToolFamily) -> tuple[int | None, list]:
    """The calls of the section whose body starts at s[i] (after the opener, if any). Raises _Invalid."""
    j = _ws(s, i)
    if j >= len(s):
        return None, []
    if fam.shape == "tagged":
        end, call = _call_object(s, j, fam) if s[j] == "{" else (None, None)
        if call is None:
            raise _Invalid
        if end is None:
            return None, [call]
        k = _ws(s, end)
        if s.startswith(fam.closer, k):
            return k + len(fam.closer), [call]
        if k >= len(s) or fam.closer.startswith(s[k:]):
            return None, [call]
        return end, [call]  # no closer: the call still counts
    if fam.shape == "array":
        if s[j] != "[":
            raise _Invalid
        return _call_list(s, j + 1, fam, sep=",", close="]")
    if fam.shape == "objects":
        if s[j] != "{":
            return _python_call(s, j)
        return _call_list(s, j, fam, sep=";", close=None)
    # wrapped: {"tool_calls": [ ... ]} with nothing else in the object
    if s[j] != "{":
        raise _Invalid
    k = _ws(s, j + 1)
    key = f'"{fam.wrapper}"'
    if len(s) - k < len(key):
        if key.startswith(s[k:]):
            return None, []
        raise _Invalid
    if not s.startswith(key, k):
        raise _Invalid
    k = _ws(s, k + len(key))
    if k >= len(s):
        return None, []
    if s[k] != ":":
        raise _Invalid
    k = _ws(s, k + 1)
    if k >= len(s):
        return None, []
    if s[k] != "[":
        raise _Invalid
    end, calls = _call_list(s, k + 1, fam, sep=",", close="]")
    if end is None:
        return None, calls
    k = _ws(s, end)
    if k >= len(s):
        return None, calls
    if s[k] != "}":
        raise _Invalid
    return k + 1, calls


def _next_start(s: str, pos: int, fam: ToolFamily) -> tuple[int, int] | None:
    """(section start, body start) of the next call section at or after pos, or None."""
    k = s.find(fam.opener, pos) if fam.opener else -1
    if fam.bare and pos == 0:
        j = _ws(s, 0)
        if j < len(s) and s[j] in "{[" and k != j:
            return j, j
    return (k, k + len(fam.opener)) if k >= 0 else None


def _held_tail(seg: str, fam: ToolFamily, at_start: bool) -> int:
    """How many trailing characters of a content segment to hold back on a partial text (they may begin a call)."""
    if at_start and fam.bare and not seg.strip():
        return len(seg)
    keep = len(seg)
    if fam.opener:
        for k in range(min(len(fam.opener) - 1, len(seg)), 0, -1):
            if seg.endswith(fam.opener[:k]):
                keep -= k
                break
    return len(seg) - len(seg[:keep].rstrip(_WS))


def _parse_harmony(text: str, fam: ToolFamily, *, final: bool) -> Parsed:
    """Content and calls of a harmony output (its non-analysis messages; calls: messages to functions.*)."""
    s = harmony.HarmonySplitter()
    _, content = s.feed(text, final=final)
    return Parsed(content, [ParsedCall(c.name, c.arguments, c.done) for c in s.calls])


def parse(text: str, fam: ToolFamily, *, final: bool = True) -> Parsed:
    """Content and calls of a model output (see the module doc for what a partial text gives)."""
    if fam.shape in PARSERS:
        return PARSERS[fam.shape](text, fam, final=final)
    segments: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    j = _ws(text, 0)
    if not final and fam.opener and j < len(text) and fam.opener.startswith(text[j:]):
        return Parsed("")  # the opener is still arriving
    while True:
        found = _next_start(text, pos, fam)
        if found is None:
            seg = text[pos:]
            if not final:
                seg = seg[:len(seg) - _held_tail(seg, fam, pos == 0)]
            segments.append(seg)
            break
        start, body = found
        try:
            end, got = _section(text, body, fam)
        except (_Invalid, ValueError):
            # not a call after all: the section's first character is content, look again after it
            end, got = None, None
        unfinished_nameless = end is None and got is not None and not any(c.name is not None for c in got)
        if got is None or (end is not None and not got) or (final and unfinished_nameless):
            nxt = max(body, start + 1)
            segments.append(text[pos:nxt])
            pos = nxt
            continue
        segments.append(text[pos:start])
        segments.append(None)  # a call section
        calls.extend(got)
        if end is None:
            break
        pos = end
    return Parsed(_join(segments, final), calls)


PARSERS: dict[str, Callable[..., Parsed]] = {"harmony": _parse_harmony}  # shapes with a parser of their own


def _join(segments: list, final: bool) -> str:
    """Content from segments (None marks a call section): blanks next to a call are dropped; a text without calls
    is returned as it is."""
    if None not in segments:
        return "".join(segments)
    out = []
    for k, seg in enumerate(segments):
        if seg is None:
            continue
        if k + 1 < len(segments) and segments[k + 1] is None:
            seg = seg.rstrip(_WS)
        if k > 0 and segments[k - 1] is None:
            seg = seg.lstrip(_WS)
        out.append(seg)
    return "".join(out)


def openai_call(call: ParsedCall, call_id: str) -> dict:
    """A parsed call as an OpenAI `tool_calls` entry."""
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ToolCallStream:
    """Turns output text, piece by piece, into OpenAI chat deltas: {"content": ...} and {"tool_calls": [{"index",
    "id", "type", "function": {"name", "arguments"}}]} (id, type and name only in a call's first delta)."""

    def __init__(self, fam: ToolFamily, new_id: Callable[[], str] | None = None):
        self.fam = fam
        self.new_id = new_id or fam.new_id
        self.text = ""
        self.ids: list[str] = []
        self._content = 0  # characters of content sent
        self._args: list[int] = []  # per call: characters of arguments sent
        self.parsed = Parsed("")

    def feed(self, piece: str, *, final: bool = False) -> list[dict]:
        """Add a piece of output text; returns the deltas it completes (final=True: the output has ended)."""
        self.text += piece
        p = self.parsed = parse(self.text, self.fam, final=final)
        out: list[dict] = []
        if len(p.content) > self._content:
            out.append({"content": p.content[self._content:]})
            self._content = len(p.content)
        for i, call in enumerate(p.calls):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(self.new_id())
                self._args.append(0)
                fn = {"name": call.name, "arguments": call.arguments}
                out.append({"tool_calls": [{"index": i, "id": self.ids[i], "type": "function", "function": fn}]})
            elif len(call.arguments) > self._args[i]:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments[self._args[i]:]}}]})
            self._args[i] = len(call.arguments)
        return out

    def finish(self) -> list[dict]:
        """The deltas the end of the output releases (held-back text that turned out to be content)."""
        return self.feed("", final=True)

    def result(self) -> tuple[str | None, list[dict]]:
        """(content or None, OpenAI tool_calls) of everything fed (call finish() first)."""
        calls = [openai_call(c, self.ids[i]) for i, c in enumerate(self.parsed.calls) if i < len(self.ids)]
        content = self.parsed.content
        return (content if content or not calls else None), calls


def parse_output(text: str, fam: ToolFamily) -> tuple[str | None, list[dict]]:
    """(content or None, OpenAI tool_calls) of a complete output: the same as streaming it through ToolCallStream."""
    s = ToolCallStream(fam)
    s.feed(text)
    s.finish()
    return s.result()
