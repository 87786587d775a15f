"""One assistant turn of a chat: the prompt from messages and tools, the constraint its sampling needs (tool calls,
reasoning budget, a JSON answer after the thinking), and its output split into reasoning, content and tool calls.
`LLM.chat`, the OpenAI routes (/v1/chat/completions, /v1/responses) and Ollama's /api/chat all go through it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from edgellm.errors import InvalidRequestError
from edgellm.reasoning import FORMATS, ReasoningGrammar, make_splitter, reasoning_mode
from edgellm.sampling import SamplingParams
from edgellm.tool_calls import GENERIC, ToolCallStream, family_for_template
from edgellm.tool_prompt import (check_choice, check_tools, generic_messages, has_tool_history, native_messages,
                                 native_tools)


@dataclass
class TurnResult:
    """The assistant's answer: content (None when it only called tools), reasoning (None if it did not think),
    OpenAI-shaped tool calls, and the finish reason ("tool_calls" when it called tools and stopped)."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    output: object = None  # the RequestOutput, from LLM.chat

    def message(self) -> dict:
        """The answer as an OpenAI assistant message."""
        m = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            m["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m


class TurnStream:
    """Output text, piece by piece -> OpenAI chat deltas ({"reasoning_content"}, {"content"}, {"tool_calls"})."""

    def __init__(self, turn: "ChatTurn"):
        self.split = make_splitter(turn.reasoning) if turn.reasoning else None
        self.calls = ToolCallStream(turn.family) if turn.choice.mode != "none" else None
        self.whole = turn.family.whole_output  # the calls' parser reads the raw output (harmony)
        self.reasoning: str | None = None
        self.content = ""

    def feed(self, piece: str, *, final: bool = False) -> list[dict]:
        """Deltas completed by this piece (final=True: the output has ended; give everything held back)."""
        thought, text = self.split.feed(piece, final=final) if self.split else ("", piece)
        out = []
        if thought:
            self.reasoning = (self.reasoning or "") + thought
            out.append({"reasoning_content": thought})
        if self.calls is not None:
            out += self.calls.feed(piece if self.whole else text, final=final)
        elif text:
            self.content += text
            out.append({"content": text})
        return out

    def finish(self) -> list[dict]:
        return self.feed("", final=True)

    def result(self, finish_reason: str | None) -> TurnResult:
        """The whole answer (after finish())."""
        content, calls = self.calls.result() if self.calls is not None else (self.content, [])
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return TurnResult(content, self.reasoning, calls, finish_reason)


class ChatTurn:
    """The prompt and constraint of one assistant turn.

    tools / tool_choice / parallel_tool_calls as in OpenAI's API (checked: ToolSpecError names the field);
    reasoning_effort: a level ("low", "medium", "high", ...) or a token budget for the thinking of reasoning models;
    template_kwargs: extra chat-template variables (enable_thinking, ...). Raises InvalidRequestError."""

    def __init__(self, llm, messages: list[dict], *, tools=None, tool_choice=None, parallel_tool_calls: bool = True,
                 reasoning_effort=None, template_kwargs: dict | None = None):
        self.tools = check_tools(tools)
        self.choice = check_choice(tool_choice, self.tools)
        tpl = llm.chat_template
        active = self.choice.mode != "none"
        self.native = tpl.uses_tools
        self.family = family_for_template(tpl.source) if self.native else GENERIC
        extra = dict(template_kwargs or {})
        if isinstance(reasoning_effort, str) and "reasoning_effort" in (tpl.source or ""):
            extra.setdefault("reasoning_effort", reasoning_effort)  # gpt-oss's template: "Reasoning: <level>"
        if self.native:
            messages = native_messages(messages, self.family)
            if active:
                extra["tools"] = native_tools(self.tools, self.family)
        elif active or has_tool_history(messages):
            messages = generic_messages(messages, self.tools if active else [])
        self.prompt = llm.render_chat(messages, add_generation_prompt=True, **extra)
        self.reasoning = reasoning_mode(tpl.source, self.prompt, reasoning_effort)
        self.grammar = None
        if active:
            from edgellm.tool_grammar import tool_grammar

            self.grammar = tool_grammar(self.family, self.tools, self.choice, parallel=parallel_tool_calls,
                                        tokenizer=llm.tokenizer)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """A copy of params with this turn's constraint (the tools' grammar, or the params' own json_schema /
        grammar, after the thinking and its budget for a reasoning model)."""
        p = copy.copy(params)
        if self.choice.mode != "none" and p.compiled_grammar is not None:
            raise InvalidRequestError("give tools or a response format / grammar, not both")
        inner = self.grammar if self.grammar is not None else p.compiled_grammar
        fmt = FORMATS[self.reasoning.format] if self.reasoning is not None else None
        if fmt is not None and (inner is not None or self.reasoning.budget is not None):
            # the answer may be a call (its grammar writes its own header) unless tools are off
            p.compiled_grammar = ReasoningGrammar(self.reasoning, inner, header=self.choice.mode == "none")
        else:
            p.compiled_grammar = inner
        if self.choice.mode != "none" or (fmt is not None and fmt.special_tokens):
            p.skip_special_tokens = False  # openers that are control tokens must show in the text
        return p

    def stream(self) -> TurnStream:
        """A parser of this turn's output as it streams."""
        return TurnStream(self)

    def result(self, text: str, finish_reason: str | None) -> TurnResult:
        """The answer in a complete output text (the same as streaming it)."""
        s = self.stream()
        s.feed(text)
        s.finish()
        return s.result(finish_reason)
