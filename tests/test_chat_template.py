"""Chat templates: official templates render as plain jinja2 renders them; built-ins, detection, errors, sandbox."""
from datetime import datetime
from pathlib import Path

import jinja2
import pytest

from edgellm.chat_template import (BUILTIN_TEMPLATES, ChatTemplate, detect_family, strip_leading_bos)
from edgellm.errors import InvalidRequestError

TEMPLATES = Path(__file__).parent / "chat_templates"

# file -> (built-in name, bos, eos); the files are copies of the official HF templates.
OFFICIAL = {
    "gemma3": ("gemma", "<bos>", "<eos>"),
    "llama3": ("llama3", "<|begin_of_text|>", "<|eot_id|>"),
    "llama3_2": (None, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2_5": ("qwen", "", "<|im_end|>"),
    "mistral": ("mistral", "<s>", "</s>"),
    "phi3": ("phi3", "<s>", "<|endoftext|>"),
}

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Hello! Who are you?"},
    {"role": "assistant", "content": "A model. Ünïcode ok: 日本語 <b>&</b>"},
    {"role": "user", "content": "  What is 2+2?  "},
]


def source(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def reference_render(src: str, messages, *, bos: str, eos: str, add_generation_prompt: bool, **extra) -> str:
    """The plainest possible rendering: an ordinary jinja2 Environment with the HF variables."""
    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(src).render(messages=messages, bos_token=bos, eos_token=eos, tools=None,
                                       add_generation_prompt=add_generation_prompt, raise_exception=raise_exception,
                                       **extra)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("file", sorted(OFFICIAL))
def test_official_templates_match_plain_jinja(file, add_generation_prompt):
    _, bos, eos = OFFICIAL[file]
    src = source(file)
    extra = {"date_string": "26 Jul 2024"} if file == "llama3_2" else {}
    got = ChatTemplate(src, bos_token=bos, eos_token=eos).render(
        CONVERSATION, add_generation_prompt=add_generation_prompt, **extra)
    want = reference_render(src, CONVERSATION, bos=bos, eos=eos, add_generation_prompt=add_generation_prompt, **extra)
    assert got == want
    assert "What is 2+2?" in got and "日本語" in got  # not a vacuous match


@pytest.mark.parametrize("file", [f for f, (builtin, _, _) in OFFICIAL.items() if builtin])
def test_builtins_are_the_official_texts(file):
    assert BUILTIN_TEMPLATES[OFFICIAL[file][0]] == source(file)


def test_gemma_builtin_two_turns_exact():
    t = ChatTemplate.builtin("gemma", bos_token="<bos>", eos_token="<eos>")
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"}]
    assert t.render(msgs) == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                              "<start_of_turn>model\nHello.<end_of_turn>\n"
                              "<start_of_turn>user\nBye<end_of_turn>\n"
                              "<start_of_turn>model\n")
    assert t.render(msgs[1:], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n")


def test_other_builtins_spot_checks():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert ChatTemplate.builtin("llama3", bos_token="<B>", eos_token="").render(msgs) == (
        "<B><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ChatTemplate.builtin("mistral", bos_token="<s>", eos_token="</s>").render(msgs) == "<s> [INST] S\n\nU [/INST]"
    assert ChatTemplate.builtin("chatml", bos_token="", eos_token="").render(msgs) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    assert ChatTemplate.builtin("phi3", bos_token="<s>", eos_token="<|endoftext|>").render(msgs) == (
        "<|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\n")
    assert ChatTemplate.builtin("qwen", bos_token="", eos_token="").render(msgs[1:]).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n")


@pytest.mark.parametrize("meta, family", [
    ({"general.architecture": "gemma3"}, "gemma"),
    ({"general.architecture": "llama", "tokenizer.ggml.tokens": ["<s>", "<start_of_turn>", "<end_of_turn>"]}, "gemma"),
    ({"general.architecture": "llama", "tokenizer.ggml.tokens": ["<|begin_of_text|>", "<|start_header_id|>"]}, "llama3"),
    ({"general.architecture": "llama", "tokenizer.ggml.pre": "llama-bpe"}, "llama3"),
    ({"general.architecture": "llama", "general.name": "Meta Llama 3.1 8B Instruct"}, "llama3"),
    ({"general.architecture": "phi3"}, "phi3"),
    ({"general.architecture": "llama", "tokenizer.ggml.tokens": ["<|user|>", "<|assistant|>", "<|end|>"]}, "phi3"),
    ({"general.architecture": "qwen2", "tokenizer.ggml.tokens": ["<|im_start|>", "<|im_end|>"]}, "qwen"),
    ({"general.architecture": "llama", "tokenizer.ggml.tokens": ["<|im_start|>", "<|im_end|>"]}, "chatml"),
    ({"general.architecture": "llama", "general.name": "Mistral-7B-Instruct-v0.2"}, "mistral"),
    ({"general.architecture": "llama", "tokenizer.ggml.tokens": ["<s>", "[INST]", "[/INST]"]}, "mistral"),
    ({"general.architecture": "llama", "general.name": "tiny random"}, None),
    ({}, None),
])
def test_family_detection(meta, family):
    assert detect_family(meta) == family


def test_file_template_wins_and_has_no_notice():
    meta = {"general.architecture": "gemma3", "tokenizer.chat_template": "{{ messages[0]['content'] }}!"}
    t = ChatTemplate.from_metadata(meta, bos_token="<bos>", eos_token="<eos>")
    assert t.notice is None and t.source == meta["tokenizer.chat_template"]
    assert t.render([{"role": "user", "content": "hi"}]) == "hi!"


def test_notice_when_falling_back():
    t = ChatTemplate.from_metadata({"general.architecture": "gemma3", "tokenizer.chat_template": ""},
                                   bos_token="<bos>", eos_token="<eos>")
    assert t.name == "gemma" and t.source == BUILTIN_TEMPLATES["gemma"]
    assert t.notice == "no chat template in the file; using the built-in 'gemma' template"
    assert t.render([{"role": "user", "content": "x"}]).startswith("<bos><start_of_turn>user\nx")

    unknown = ChatTemplate.from_metadata({"general.architecture": "llama"}, bos_token="<s>", eos_token="</s>")
    assert unknown.name == "chatml" and "\n" not in unknown.notice and "'chatml'" in unknown.notice


def test_raise_exception_is_invalid_request():
    t = ChatTemplate.builtin("gemma", bos_token="<bos>", eos_token="<eos>")
    with pytest.raises(InvalidRequestError, match=r"^Conversation roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize("src", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = messages.append({'role': 'user'}) %}",  # immutable sandbox: no mutation of the caller's data
])
def test_sandbox_blocks_escapes(src):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError) as info:
        ChatTemplate(src).render(msgs)
    assert isinstance(info.value.__cause__, jinja2.exceptions.SecurityError)
    assert "\n" not in str(info.value)
    assert msgs == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("src, render_args", [
    ("{% for m in messages %}{{ m.role ", None),  # syntax error at compile time
    ("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}]),  # TypeError inside the template
    ("{{ messages[5]['role'] }}", [{"role": "user", "content": "x"}]),  # undefined access
    ("{{ 1 // 0 }}", [{"role": "user", "content": "x"}]),
])
def test_template_errors_are_one_line_invalid_request(src, render_args):
    with pytest.raises(InvalidRequestError) as info:
        ChatTemplate(src, name="t").render(render_args)
    assert "\n" not in str(info.value) and "chat template 't'" in str(info.value)


@pytest.mark.parametrize("messages", [[], "hi", [{"content": "no role"}], [["user", "hi"]]])
def test_bad_messages(messages):
    with pytest.raises(InvalidRequestError):
        ChatTemplate.builtin("chatml", bos_token="", eos_token="").render(messages)


def test_tojson_like_transformers_and_tools_default_none():
    t = ChatTemplate("{{ tools is none }} {{ {'a': 'é<&>'} | tojson }} {{ [1, 2] | tojson(indent=2) }}")
    assert t.render([{"role": "user", "content": ""}]) == 'True {"a": "é<&>"} [\n  1,\n  2\n]'


def test_strftime_now_and_extra_variables():
    src = source("llama3_2")
    t = ChatTemplate(src, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    msgs = [{"role": "user", "content": "hi"}]
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}\n" in t.render(msgs)
    assert "Today Date: 01 Jan 2000\n" in t.render(msgs, date_string="01 Jan 2000")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "ü"}}}]
    rendered = t.render(msgs, tools=tools)
    assert '"x": "ü"' in rendered and "Environment: ipython" in rendered


def test_generation_tag_and_loopcontrols():
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                     "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a]"


def test_strip_leading_bos():
    assert strip_leading_bos("<bos><start_of_turn>user", "<bos>") == "<start_of_turn>user"
    assert strip_leading_bos("<bos><bos>x", "<bos>") == "<bos>x"  # only one
    assert strip_leading_bos("<|im_start|>user", "<bos>") == "<|im_start|>user"
    assert strip_leading_bos("<s>x", "") == "<s>x"
