"""Chat templates: a conversation (list of {"role", "content"} dicts) -> prompt text, as transformers does it.

The template is the GGUF key ``tokenizer.chat_template`` (the HF ``chat_template`` of the model), rendered with
jinja2's ``ImmutableSandboxedEnvironment`` under the same settings and names as ``apply_chat_template``:
trim_blocks, lstrip_blocks, the loopcontrols extension, ``{% generation %}``, ``bos_token``, ``eos_token``,
``raise_exception``, ``strftime_now``, ``tools=None`` and an HF-style ``tojson`` (ensure_ascii=False).
A file without a template gets the official template of its family (detected from metadata, ``FAMILY_RULES``).

BOS rule: ``render`` returns exactly the text of ``apply_chat_template(..., tokenize=False)``, so templates that
write ``{{ bos_token }}`` (gemma, llama3, mistral) put the BOS *text* first. Tokenize that text with special-token
parsing on. If the tokenizer also prepends BOS itself (GGUF ``tokenizer.ggml.add_bos_token``, the default for these
families), pass the text through ``strip_leading_bos`` first -- llama.cpp does the same in common/chat.cpp -- so the
prompt starts with exactly one BOS.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgellm.errors import InvalidRequestError

# Official template texts, byte for byte as shipped in the HF tokenizer_config.json of each model.
BUILTIN_TEMPLATES: dict[str, str] = {
    # google/gemma-3-*-it: the system prompt is merged into the first user turn.
    "gemma": r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
""",
    # meta-llama/Meta-Llama-3-8B-Instruct (3.1+ add a dated system header; their files carry their own template).
    "llama3": "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>'"
    " + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    # microsoft/Phi-3-mini-4k-instruct
    "phi3": "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] +"
    " '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif "
    "message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}",
    # mistralai/Mistral-7B-Instruct-v0.2 (the system message goes into the first [INST]).
    "mistral": r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
""",
    # Qwen/Qwen2.5-*-Instruct (ChatML with a default system prompt and tool calls).
    "qwen": r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""",
    # Plain ChatML (the transformers documentation's template), for <|im_start|> models that are not Qwen.
    "chatml": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
}


@dataclass(frozen=True)
class ModelFacts:
    """What family detection looks at: general.architecture, general.name (lower case), tokenizer.ggml.pre, vocab."""

    arch: str
    name: str
    pre: str
    tokens: frozenset

    @classmethod
    def from_metadata(cls, meta: dict) -> "ModelFacts":
        """Collect the facts from a GGUF metadata dict (missing keys become empty)."""
        text = lambda key: str(meta.get(key) or "").lower()  # noqa: E731
        toks = meta.get("tokenizer.ggml.tokens") or ()
        return cls(text("general.architecture"), text("general.name"), text("tokenizer.ggml.pre"),
                   frozenset(t for t in toks if isinstance(t, str)))


# (predicate -> built-in template name); the first rule that holds wins.
FAMILY_RULES: tuple[tuple[Callable[[ModelFacts], bool], str], ...] = (
    (lambda f: f.arch.startswith("gemma") or "<start_of_turn>" in f.tokens, "gemma"),
    (lambda f: "<|start_header_id|>" in f.tokens or f.pre == "llama-bpe" or re.search(r"llama[\s_-]*3", f.name),
     "llama3"),
    (lambda f: f.arch == "phi3" or {"<|user|>", "<|assistant|>", "<|end|>"} <= f.tokens, "phi3"),
    (lambda f: f.arch.startswith("qwen") or f.pre.startswith("qwen") or "qwen" in f.name, "qwen"),
    (lambda f: "<|im_start|>" in f.tokens, "chatml"),
    (lambda f: f.arch.startswith("mistral") or "[INST]" in f.tokens or re.search(r"mi[sx]tral", f.name), "mistral"),
)
FALLBACK_TEMPLATE = "chatml"  # llama.cpp's default for an unknown family too


def detect_family(meta: dict) -> str | None:
    """Name of the built-in template that fits the model described by ``meta``, or None if no rule matches."""
    facts = ModelFacts.from_metadata(meta)
    return next((name for rule, name in FAMILY_RULES if rule(facts)), None)


def strip_leading_bos(text: str, bos_token: str) -> str:
    """Remove one leading ``bos_token`` from rendered text; use it when the tokenizer adds BOS itself."""
    return text[len(bos_token):] if bos_token and text.startswith(bos_token) else text


def _raise_exception(message: Any) -> None:
    raise InvalidRequestError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' tojson: plain json.dumps, no HTML escaping (jinja's own filter escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, but reaching for an unsafe attribute fails at once instead of rendering as ''."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


_ENV = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
_ENV.filters["tojson"] = _tojson
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)


def _one_line(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, jinja2.TemplateError) and exc.message else str(exc)
    return (text.strip().splitlines() or [type(exc).__name__])[0]


class ChatTemplate:
    """A compiled chat template. ``name`` says where it came from, ``source`` is the jinja text and ``notice`` is
    a one-line remark for the user when a built-in template stands in for a missing one (else None)."""

    def __init__(self, source: str, *, name: str = "custom", bos_token: str = "", eos_token: str = "",
                 notice: str | None = None):
        """Compile ``source``; a syntax error raises InvalidRequestError."""
        self.name, self.source, self.notice = name, source, notice
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise InvalidRequestError(f"chat template {name!r} has a syntax error at line {e.lineno}: "
                                      f"{_one_line(e)}") from e

    @property
    def uses_tools(self) -> bool:
        """Whether the template reads the ``tools`` variable (renders tool definitions itself)."""
        if not hasattr(self, "_uses_tools"):
            from jinja2 import meta

            self._uses_tools = "tools" in meta.find_undeclared_variables(_ENV.parse(self.source))
        return self._uses_tools

    @classmethod
    def builtin(cls, name: str, *, bos_token: str, eos_token: str, notice: str | None = None) -> "ChatTemplate":
        """The built-in template ``name`` (a key of BUILTIN_TEMPLATES)."""
        if name not in BUILTIN_TEMPLATES:
            raise InvalidRequestError(f"unknown chat template {name!r}; built-in: {', '.join(BUILTIN_TEMPLATES)}")
        return cls(BUILTIN_TEMPLATES[name], name=name, bos_token=bos_token, eos_token=eos_token, notice=notice)

    @classmethod
    def from_metadata(cls, meta: dict, *, bos_token: str, eos_token: str) -> "ChatTemplate":
        """The template of a GGUF file: ``tokenizer.chat_template`` if present, else the built-in template of the
        detected family (``FAMILY_RULES``, falling back to chatml), with ``notice`` saying so."""
        source = meta.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            return cls(source, name="tokenizer.chat_template", bos_token=bos_token, eos_token=eos_token)
        family = detect_family(meta)
        why = "no chat template in the file" + ("" if family else " and the model family is unknown")
        family = family or FALLBACK_TEMPLATE
        return cls.builtin(family, bos_token=bos_token, eos_token=eos_token,
                           notice=f"{why}; using the built-in {family!r} template")

    @classmethod
    def for_model(cls, meta: dict, tokenizer) -> "ChatTemplate":
        """``from_metadata`` with the BOS / EOS token texts of the model's tokenizer."""
        text = lambda i: tokenizer.tokens[i] if i is not None else ""  # noqa: E731
        return cls.from_metadata(meta, bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id))

    def render_prompt(self, messages: list[dict], *, tokenizer_adds_bos: bool, add_generation_prompt: bool = True,
                      **extra: Any) -> str:
        """``render``, then the leading BOS text stripped if the tokenizer adds BOS itself: tokenized with
        special-token parsing, the text gives exactly one BOS (see the module doc)."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **extra)
        return strip_leading_bos(text, self.bos_token) if tokenizer_adds_bos else text

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render ``messages`` to prompt text (BOS text included if the template writes it; see the module doc).

        ``extra`` adds or overrides template variables (``tools``, ``date_string``, ``enable_thinking``, ...).
        Bad messages, ``raise_exception`` in the template and any template failure raise InvalidRequestError."""
        if not (isinstance(messages, list) and messages
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
            raise InvalidRequestError("messages must be a non-empty list of {'role': str, 'content': ...} dicts")
        context = dict(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                       add_generation_prompt=add_generation_prompt, tools=None)
        context.update(extra)
        try:
            return self._template.render(**context)
        except InvalidRequestError:
            raise
        except SecurityError as e:
            raise InvalidRequestError(f"chat template {self.name!r} did something unsafe: {_one_line(e)}") from e
        except Exception as e:  # a template is data: whatever breaks in it is a bad request, not a crash
            raise InvalidRequestError(f"chat template {self.name!r} failed: {type(e).__name__}: "
                                      f"{_one_line(e)}") from e
