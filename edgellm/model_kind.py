"""Base or instruct: what a GGUF file's metadata says about a model, which chat model to pull instead, and how
to chat with a base model anyway.

A base (pretrained) model continues text; it was never taught to answer in turns. `edgellm chat` says so in one
line, then chats completion-style: the conversation is a plain "User: ... / Assistant:" transcript the model
continues, stopped where it starts the next "User:" line (a base model answers that far better than a chat
template it never saw, whose control tokens it tends to echo). `edgellm info` and `edgellm list` show the kind. The rules, in order: ``general.finetune`` (written by
llama.cpp's converter from the HF name: "it", "Instruct", "pt", "Base", ...) names the kind; a file without
``tokenizer.chat_template`` is a base model; ``general.name`` / ``general.basename`` / ``general.tags`` that say
"base" or "pretrained" name one; anything else with a chat template is an instruct model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

BASE_WORDS = frozenset({"base", "pt", "pretrained", "pretrain"})
INSTRUCT_WORDS = frozenset({"it", "instruct", "chat", "sft", "dpo", "orpo", "kto", "grpo", "rlhf", "assistant",
                            "thinking", "reasoning", "conversational"})
# A small instruction-tuned model per architecture that edgellm runs (general.architecture -> Hugging Face repo).
INSTRUCT_REPOS: dict[str, str] = {
    "gemma3": "ggml-org/gemma-3-1b-it-GGUF",
    "qwen2": "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
    "qwen3": "Qwen/Qwen3-0.6B-GGUF",
    "llama": "bartowski/Llama-3.2-1B-Instruct-GGUF",
}
DEFAULT_INSTRUCT_REPO = INSTRUCT_REPOS["gemma3"]
# The completion-style chat of a base model: a system prompt as a first paragraph, then "User: ..." and
# "Assistant: ..." lines; the prompt ends with "Assistant:" and the answer stops before the next "\nUser:".
COMPLETION_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\n' }}"
    "{% else %}{{ 'Assistant:' + ('' if m['content'].startswith(' ') else ' ') + m['content'] + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
COMPLETION_STOPS = ("\nUser:",)


@dataclass(frozen=True)
class ModelKind:
    """``kind`` is "base" or "instruct"; ``why`` says which metadata decided it (a few words)."""

    kind: str
    why: str

    @property
    def is_base(self) -> bool:
        return self.kind == "base"


def _words(text: Any) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", text.lower())) - {""} if isinstance(text, str) else set()


def model_kind(meta: Mapping[str, Any]) -> ModelKind:
    """Base or instruct, from GGUF metadata (see the module doc for the rules)."""
    template = meta.get("tokenizer.chat_template")
    has_template = isinstance(template, str) and bool(template.strip())
    finetune = meta.get("general.finetune")
    ft = _words(finetune)
    if ft & BASE_WORDS:
        return ModelKind("base", f"general.finetune is {finetune!r}")
    if not has_template:
        return ModelKind("base", "no chat template in the file")
    if ft & INSTRUCT_WORDS:
        return ModelKind("instruct", f"general.finetune is {finetune!r}")
    for key in ("general.name", "general.basename"):
        if _words(meta.get(key)) & {"base", "pretrained"}:
            return ModelKind("base", f"{key} is {meta[key]!r}")
    tags = meta.get("general.tags")
    if tags is not None and not isinstance(tags, str):
        named = [t for t in tags if isinstance(t, str) and ":" not in t and _words(t) & {"base", "pretrained"}]
        if named:
            return ModelKind("base", f"general.tags has {named[0]!r}")
    return ModelKind("instruct", "has a chat template")


def instruct_repo(meta: Mapping[str, Any]) -> str:
    """A Hugging Face repo of a small instruction-tuned model of the same family (else the default one)."""
    return INSTRUCT_REPOS.get(str(meta.get("general.architecture", "")), DEFAULT_INSTRUCT_REPO)


def base_model_notice(meta: Mapping[str, Any], name: str) -> str | None:
    """The one line `edgellm chat` prints for a base model (None for an instruct model)."""
    k = model_kind(meta)
    if not k.is_base:
        return None
    repo = instruct_repo(meta)
    return (f"{name} is a base model ({k.why}): it continues text rather than following instructions, so this "
            f"chat is a User:/Assistant: transcript it completes; for a chat model run: edgellm pull {repo}  "
            f"(then edgellm chat -m {repo})")


def completion_template(tokenizer):
    """The ChatTemplate of a base model's completion-style chat (COMPLETION_TEMPLATE; stop on COMPLETION_STOPS)."""
    from edgellm.chat_template import ChatTemplate

    text = lambda i: tokenizer.tokens[i] if i is not None else ""  # noqa: E731
    return ChatTemplate(COMPLETION_TEMPLATE, name="completion", bos_token=text(tokenizer.bos_id),
                        eos_token=text(tokenizer.eos_id))
