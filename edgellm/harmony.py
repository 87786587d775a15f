"""OpenAI's harmony format (gpt-oss): the assistant's output is a run of messages, each a header, `<|message|>`, its
text and an end tag, the later ones opened by `<|start|>`:

    <|channel|>analysis<|message|>thinking...<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>

The "analysis" channel is the reasoning, every other channel ("final", "commentary") the answer. A message whose
header names a function as its recipient is a tool call, its text the call's JSON arguments, ended by `<|call|>`:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>

(the recipient may also come before the channel: `<|start|>assistant to=functions.get_weather<|channel|>commentary
json<|message|>`, as the chat template renders past calls). The chat template's generation prompt ends with
`<|start|>assistant`, so the output begins inside a header. `HarmonySplitter` turns the output text into reasoning and
content deltas and a list of calls, the same streamed or not (partial tags held back); edgellm.reasoning registers it
as the "harmony" reasoning format, edgellm.tool_calls as the "harmony" tool-call family. The tags are special
tokens: the turn's text must keep them (SamplingParams.skip_special_tokens = False).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
REASONING_CHANNELS = frozenset({"analysis"})
FUNCTIONS = "functions."  # the recipient namespace of the request's function tools
MAX_HEADER = 512  # characters of a header before its text is taken as plain answer text instead
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_WS = " \t\r\n"


def is_harmony(template_source: str | None) -> bool:
    """A chat template that writes harmony channels."""
    src = template_source or ""
    return CHANNEL in src and MESSAGE in src


def _partial_tail(text: str, tags) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of tags."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


@dataclass
class HarmonyCall:
    """A call message as read so far: the function's name, its arguments text (a prefix while the message is still
    open) and whether its end tag came."""

    name: str
    arguments: str = ""
    done: bool = False


class HarmonySplitter:
    """Harmony output text -> (reasoning delta, content delta), piece by piece; call messages go to `calls`."""

    def __init__(self, start: str = "header"):
        self.state = start  # "header" | "body" | "between" (after an end tag)
        self.opened = False  # a <|start|> was read: the header names a role first
        self.target = "content"  # where the current message's text goes: "reasoning", "content" or "call"
        self.buf = ""
        self.calls: list[HarmonyCall] = []

    def feed(self, piece: str, *, final: bool = False) -> tuple[str, str]:
        self.buf += piece
        out = {"reasoning": "", "content": ""}
        while True:
            before = (self.state, len(self.buf))
            getattr(self, "_" + self.state)(out, final)
            if (self.state, len(self.buf)) == before:
                break
        return out["reasoning"], out["content"]

    def _header(self, out: dict, final: bool) -> None:
        k = self.buf.find(MESSAGE)
        if k >= 0:
            head = self.buf[:k]
            m, to = _CHANNEL_NAME.search(head), _RECIPIENT.search(head)
            self.target = "reasoning" if m and m.group(1) in REASONING_CHANNELS else "content"
            if to and to.group(1).startswith(FUNCTIONS):
                self.target = "call"
                self.calls.append(HarmonyCall(to.group(1)[len(FUNCTIONS):]))
            self.state, self.buf = "body", self.buf[k + len(MESSAGE):]
            return
        lead = self.buf.lstrip(_WS)
        plain = not self.opened and lead and not lead.startswith("<|") and not "<|".startswith(lead)
        if plain or len(self.buf) > MAX_HEADER:  # no header: the model answered in plain text
            self.state, self.target = "body", "content"
        elif final:
            self.buf = ""  # cut off inside a header: nothing to show

    def _body(self, out: dict, final: bool) -> None:
        ends = [(i, t) for t in ENDS if (i := self.buf.find(t)) >= 0]
        if ends:
            i, tag = min(ends)
            self._emit(out, self.buf[:i])
            if self.target == "call":
                self.calls[-1].done = True
            self.state, self.buf = "between", self.buf[i + len(tag):]
            return
        hold = 0 if final else _partial_tail(self.buf, ENDS)
        self._emit(out, self.buf[:len(self.buf) - hold])
        self.buf = self.buf[len(self.buf) - hold:]

    def _emit(self, out: dict, text: str) -> None:
        if self.target == "call":
            self.calls[-1].arguments += text
        else:
            out[self.target] += text

    def _between(self, out: dict, final: bool) -> None:
        lead = self.buf.lstrip(_WS)
        if lead.startswith(START):
            self.state, self.opened, self.buf = "header", True, lead[len(START):]
        elif lead and not START.startswith(lead):
            self.state, self.target, self.buf = "body", "content", lead  # text after the last message
        elif final:
            self.buf = ""
