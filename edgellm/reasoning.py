"""Reasoning models (`<think>...</think>`, as DeepSeek-R1 distills and Qwen3 write them): the thinking split from
the answer, a budget that ends the thinking by inserting the closing tag, and structured output that starts after it.
Other ways of writing the thinking are entries of FORMATS (read off the chat template): "harmony" (gpt-oss's
analysis channel, edgellm/harmony.py), whose budget and phases work the same way with its own tags (`Marks`).

A template that writes `<think>` marks a reasoning model. The rendered prompt tells how its output begins
(`ReasoningMode.start`): "open" when the prompt ends inside `<think>` (R1 distills add it to the generation prompt),
"maybe" when the model opens it itself (Qwen3), none when the prompt closed an empty block (Qwen3 with
enable_thinking=false). `ReasoningSplitter` turns output text into reasoning and content deltas (blank lines around
the tags dropped, partial tags held back), the same streamed or not.

`ReasoningGrammar` is a compiled constraint for SamplingParams.compiled_grammar whose matcher runs in phases: force
the opening tag (start "maybe" with a budget or a constraint), think freely, force the closing tag once the budget
is spent, then hand the answer to the inner constraint (a JSON schema, tool calls) if any. So a schema never blocks
the model's `</think>`. For harmony the tags are the analysis channel's header, its `<|end|>` and the next message's
`<|start|>assistant`; the answer's header (`<|channel|>final<|message|>`) is forced before a response format,
while a tool-call grammar writes its own (`<|channel|>commentary to=functions.NAME ...`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgellm import harmony
from edgellm.errors import InvalidRequestError

OPEN, CLOSE = "<think>", "</think>"
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 0, "low": 256, "medium": 1024, "high": None}
_WS = " \t\r\n"


@dataclass(frozen=True)
class ReasoningMode:
    """How a reasoning turn's output begins ("open": inside the thinking, "maybe": the model may open it; harmony:
    "header") and its budget in thinking tokens (None: unlimited); format: a key of FORMATS."""

    start: str
    budget: int | None = None
    format: str = "think"


def budget_tokens(effort) -> int | None:
    """Thinking tokens for reasoning_effort (a level of EFFORT_BUDGETS or a token count >= 0; None: unlimited)."""
    if effort is None:
        return None
    if isinstance(effort, bool) or not isinstance(effort, (int, str)):
        raise InvalidRequestError("reasoning_effort must be one of " + ", ".join(EFFORT_BUDGETS)
                                  + " or a number of tokens")
    if isinstance(effort, int):
        if effort < 0:
            raise InvalidRequestError("a reasoning budget must be >= 0 tokens")
        return effort
    if effort not in EFFORT_BUDGETS:
        raise InvalidRequestError(f"reasoning_effort must be one of {', '.join(EFFORT_BUDGETS)} (got {effort!r})")
    return EFFORT_BUDGETS[effort]


def reasoning_mode(template_source: str | None, prompt: str, effort=None) -> ReasoningMode | None:
    """The reasoning mode of a turn (None: the model does not think here), by the first format of FORMATS whose
    marks the template has."""
    for fmt in FORMATS.values():
        if fmt.detect(template_source or ""):
            return fmt.mode(prompt, effort)
    return None


def make_splitter(mode: ReasoningMode):
    """The output splitter of a reasoning turn: .feed(piece, final=) -> (reasoning delta, content delta)."""
    return FORMATS[mode.format].splitter(mode.start)


def _harmony_mode(prompt: str, effort) -> ReasoningMode:
    """gpt-oss: a level goes into the template's system message ("Reasoning: low"), not a budget; a token count (or
    "none" / "minimal": 0) is a budget of analysis tokens."""
    budget = budget_tokens(effort)
    return ReasoningMode("header", budget if isinstance(effort, int) or budget == 0 else None, format="harmony")


def _think_mode(prompt: str, effort) -> ReasoningMode | None:
    o, c = prompt.rfind(OPEN), prompt.rfind(CLOSE)
    if o > c:
        return ReasoningMode("open", budget_tokens(effort))
    if c >= 0 and not prompt[c + len(CLOSE):].strip(_WS):
        return None  # the prompt closed an (empty) thinking block: thinking is off
    return ReasoningMode("maybe", budget_tokens(effort))


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Output text -> (reasoning delta, content delta), piece by piece. Blanks after the opening tag, before and
    after the closing one are dropped; text that may begin a tag is held back until it is known."""

    def __init__(self, start: str):
        self.state = "think" if start == "open" else "pre"
        self.buf = ""  # text not yet given out
        self.started = False  # reasoning text has begun (leading blanks dropped)

    def feed(self, piece: str, *, final: bool = False) -> tuple[str, str]:
        self.buf += piece
        reasoning = content = ""
        if self.state == "pre":
            lead = self.buf.lstrip(_WS)
            if lead.startswith(OPEN):
                self.state, self.buf = "think", lead[len(OPEN):]
            elif OPEN.startswith(lead) and not final:
                return "", ""
            else:
                self.state = "content"
        if self.state == "think":
            k = self.buf.find(CLOSE)
            if k >= 0:
                reasoning = self._think(self.buf[:k], final=True)
                self.state, self.buf = "after", self.buf[k + len(CLOSE):]
            else:
                hold = 0 if final else _partial_tail(self.buf, CLOSE)
                text = self.buf[:len(self.buf) - hold]
                body = text if final else text.rstrip(_WS)
                reasoning = self._think(body, final=False)
                self.buf = self.buf[len(body):]
                if final:
                    self.buf = ""
        if self.state == "after":
            lead = self.buf.lstrip(_WS)
            if lead or final:
                self.state, self.buf = "content", lead
        if self.state == "content":
            content, self.buf = self.buf, ""
        return reasoning, content

    def _think(self, text: str, *, final: bool) -> str:
        if not self.started:
            text = text.lstrip(_WS)
            self.started = bool(text)
        return text.rstrip(_WS) if final else text


def _think_tail(thought: str) -> str:
    return CLOSE + "\n\n" if not thought or thought.endswith("\n") else "\n" + CLOSE + "\n\n"


@dataclass(frozen=True)
class Marks:
    """The texts the phased matcher forces or watches for: opener (forced unless the prompt opened the thinking),
    closer (the model ends its thinking by writing it), tail(thought so far) (forced when the budget is spent),
    after_close (forced after the model's own closer), header (forced before an answer whose constraint does not
    write its own)."""

    opener: str
    closer: str
    tail: Callable[[str], str]
    after_close: str = ""
    header: str = ""


@dataclass(frozen=True)
class ReasoningFormat:
    """One way reasoning models write their thinking: detect(template source) says a template uses it, mode(prompt,
    effort) gives the turn's ReasoningMode (or None), splitter(start) splits the output, marks drive
    ReasoningGrammar (budget, a constraint after the thinking); special_tokens: the output text must keep special
    tokens."""

    detect: Callable[[str], bool]
    mode: Callable[[str, object], ReasoningMode | None]
    splitter: Callable[[str], object]
    marks: Marks
    special_tokens: bool = False


_ANSWER = harmony.START + "assistant"
FORMATS: dict[str, ReasoningFormat] = {  # checked in this order
    "harmony": ReasoningFormat(
        harmony.is_harmony, _harmony_mode, harmony.HarmonySplitter,
        Marks(harmony.CHANNEL + "analysis" + harmony.MESSAGE, harmony.ENDS[0], lambda t: harmony.ENDS[0] + _ANSWER,
              after_close=_ANSWER, header=harmony.CHANNEL + "final" + harmony.MESSAGE),
        special_tokens=True),
    "think": ReasoningFormat(lambda src: OPEN in src, _think_mode, ReasoningSplitter,
                             Marks(OPEN + "\n", CLOSE, _think_tail)),
}


# -- the phased matcher ----------------------------------------------------------------------------------------
@dataclass
class ReasoningGrammar:
    """A compiled constraint (SamplingParams.compiled_grammar) for a reasoning turn: `inner` (an llguidance grammar,
    or None) applies to the answer after the thinking; the mode's budget caps the thinking tokens; header: force the
    format's answer header first (False when the answer may be a tool call, whose grammar writes its own)."""

    mode: ReasoningMode
    inner: object = None
    header: bool = True

    def matcher(self, tokenizer) -> "ReasoningMatcher":
        return ReasoningMatcher(self, tokenizer)


class ReasoningMatcher:
    """GrammarMatcher's interface (fill_mask / apply / accept) over the phases of a ReasoningGrammar."""

    def __init__(self, g: ReasoningGrammar, tokenizer):
        from edgellm.structured import make_matcher

        self.tok = tokenizer
        self.marks = FORMATS[g.mode.format].marks
        self.header = self.marks.header if g.header else ""
        self.budget = g.mode.budget
        self.inner = make_matcher(g.inner, tokenizer) if g.inner is not None else None
        self.forced: list[int] = []
        self.phase = "think"
        if g.mode.start != "open":
            self.forced = self._ids(self.marks.opener)
        self.text = ""  # thinking text so far
        self.n_think = 0
        self._maybe_close()

    def _ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_bos=False, special=True) if text else []

    def _maybe_close(self) -> None:
        if not self.forced and self.phase == "think" and self.budget is not None and self.n_think >= self.budget:
            self._close(self.marks.tail(self.text))

    def _close(self, forced: str) -> None:
        """End the thinking: force `forced` and the answer's header, then the answer."""
        self.forced = self._ids(forced + self.header)
        self.phase = "closing" if self.forced else "answer"

    def fill_mask(self) -> None:
        if self.phase == "answer" and not self.forced and self.inner is not None:
            self.inner.fill_mask()

    def apply(self, logits: np.ndarray) -> np.ndarray:
        if self.forced:
            out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
            out[self.forced[0]] = logits[self.forced[0]]
            return out
        if self.phase == "answer" and self.inner is not None:
            return self.inner.apply(logits)
        return logits

    def accept(self, token: int) -> bool:
        """Advance with the sampled token; True when the answer's constraint is complete."""
        if self.forced:
            self.forced.pop(0)
            if not self.forced and self.phase == "closing":
                self.phase = "answer"
            elif self.phase == "think":
                self._maybe_close()
            return False
        if self.phase == "answer":
            return self.inner.accept(token) if self.inner is not None else False
        self.text += self.tok.token_to_piece(int(token)).decode("utf-8", "replace")
        self.n_think += 1
        k = self.text.find(self.marks.closer)
        if k >= 0:  # the model closed its thinking itself
            self._close(self.marks.after_close)
            rest = self.text[k + len(self.marks.closer):].lstrip(_WS)
            if rest and self.inner is not None and self.phase == "answer":
                # the closing token carried answer text: the constraint sees it
                for t in self.tok.encode(rest, add_bos=False, special=False):
                    if self.inner.accept(t):
                        return True
            return False
        self._maybe_close()
        return False
