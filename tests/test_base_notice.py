"""A base model is named as such: `edgellm chat` says so in one line and what to pull instead, then chats on;
`edgellm info` shows base vs instruct. The rules of edgellm/model_kind.py on metadata."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pexpect
import pytest

import tiny_models as tm
from edgellm.model_kind import base_model_notice, model_kind
from timing import scaled

REPO_ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


@pytest.mark.parametrize("meta, kind", [
    ({}, "base"),  # no chat template
    ({"tokenizer.chat_template": TEMPLATE}, "instruct"),
    ({"tokenizer.chat_template": TEMPLATE, "general.finetune": "it"}, "instruct"),
    ({"tokenizer.chat_template": TEMPLATE, "general.finetune": "pt"}, "base"),  # gemma-3-1b-pt
    ({"tokenizer.chat_template": TEMPLATE, "general.name": "Qwen3 0.6B Base"}, "base"),
    ({"tokenizer.chat_template": TEMPLATE, "general.name": "Qwen3 0.6B Base", "general.finetune": "Instruct"},
     "instruct"),
    ({"tokenizer.chat_template": TEMPLATE, "general.tags": ["text-generation", "base"]}, "base"),
    ({"tokenizer.chat_template": TEMPLATE, "general.tags": ["base_model:finetune:org/x-base"]}, "instruct"),
    ({"general.finetune": "Instruct"}, "base"),  # says instruct, but there is no template to chat with
])
def test_model_kind_rules(meta, kind):
    assert model_kind(meta).kind == kind


def test_notice_names_a_chat_model_of_the_family():
    line = base_model_notice({"general.architecture": "qwen2"}, "Qwen2.5 0.5B")
    assert line.startswith("Qwen2.5 0.5B is a base model (no chat template in the file)")
    assert "edgellm pull Qwen/Qwen2.5-0.5B-Instruct-GGUF" in line and "\n" not in line
    assert base_model_notice({"tokenizer.chat_template": TEMPLATE}, "x") is None


def test_completion_template_is_a_transcript_each_turn_extends():
    from edgellm.model_kind import COMPLETION_STOPS, completion_template

    tok = SimpleNamespace(tokens=["<pad>", "<bos>", "<eos>"], bos_id=1, eos_id=2)
    t = completion_template(tok)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    p1 = t.render(first)
    assert p1 == "Be brief.\n\nUser: Hi\nAssistant:"
    answer = " Hello."  # as generated: a leading space, then the stop string cut
    p2 = t.render(first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Bye"}])
    assert p2 == p1 + answer + COMPLETION_STOPS[0] + " Bye\nAssistant:"  # the old prompt + answer, then more
    assert t.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                    add_generation_prompt=False) == "User: a\nAssistant: b\n"


def _ui_notice(meta: dict, template_notice: str | None) -> str | None:
    from edgellm.chat_ui import ChatUI

    session = SimpleNamespace(llm=SimpleNamespace(loaded=SimpleNamespace(metadata=meta, path="/m/x.gguf")),
                              template=SimpleNamespace(notice=template_notice), notify=None)
    return ChatUI(session, interactive=False).model_notice()


def test_chat_ui_says_base_first_else_the_template_notice():
    assert _ui_notice({"general.architecture": "gemma3"}, "no chat template in the file; using the built-in "
                      "'gemma' template").startswith("x.gguf is a base model")  # one line: the base notice
    assert _ui_notice({"tokenizer.chat_template": TEMPLATE}, None) is None
    assert _ui_notice({"tokenizer.chat_template": TEMPLATE, "general.finetune": "pt"}, None).startswith(
        "x.gguf is a base model (general.finetune is 'pt')")


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *args], capture_output=True, text=True,
                          timeout=scaled(300), cwd=str(REPO_ROOT))


def test_info_shows_base_or_instruct(default_model, tmp_path):
    r = cli("info", "-m", default_model)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^kind\s+base \(no chat template in the file\)$", r.stdout, re.M)
    path = tm.write_spec(tmp_path / "tiny-it.gguf", tm.tiny_spec("llama"),
                         strings={"general.finetune": "it", "tokenizer.chat_template": TEMPLATE})
    r = cli("info", "-m", str(path), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["kind"], d["kind_reason"]) == ("instruct", "general.finetune is 'it'")


@pytest.mark.slow
def test_chat_on_the_bundled_base_model_says_so_then_chats(default_model, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               EDGELLM_MODEL=default_model, EDGELLM_CACHE=str(tmp_path), NO_COLOR="1", TERM="dumb")
    child = pexpect.spawn(sys.executable, ["-m", "edgellm.cli", "chat", "--threads", "2", "--ctx-size", "512",
                                           "--temperature", "0", "--max-tokens", "12"],
                          env=env, cwd=str(REPO_ROOT), encoding="utf-8", timeout=scaled(240), dimensions=(40, 240))
    try:
        child.expect(r"note: (.*) is a base model \(no chat template in the file\): it continues text rather than "
                     r"following instructions, so this chat is a User:/Assistant: transcript it completes; for a "
                     r"chat model run: edgellm pull ggml-org/gemma-3-1b-it-GGUF  "
                     r"\(then edgellm chat -m ggml-org/gemma-3-1b-it-GGUF\)\r\n")
        assert child.match.group(1) == "Gemma 3 270m"
        child.expect_exact(">>> ")
        before = child.before
        assert "base model" not in before and "built-in" not in before  # said once, in one line
        child.sendline("What is the capital of France?")
        child.expect(r"\r\n(.*)\r\n\[prefill \d+ new / \d+ cached tokens[^\]]*\]")  # an answer, then the status
        assert "Paris" in child.match.group(1) and "User:" not in child.match.group(1)  # completed, then stopped
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
