"""edgellm chat: session logic against a scripted fake LLM (fast), then the real CLI on the default model
through a pseudo-terminal (pexpect) and through a pipe."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace

import pexpect
import pytest

from edgellm.chat import ChatSession, parse_messages
from edgellm.chat_template import ChatTemplate
from edgellm.chat_ui import ChatUI
from edgellm.errors import ContextOverflowError, InvalidRequestError
from edgellm.sampling import SamplingParams
from timing import scaled

REPO = Path(__file__).resolve().parents[1]


# -- a scripted stand-in for LLM: char-level tokens, answers from a list --------------------------------------
class FakeTokenizer:
    tokens = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    add_bos, bos_id, eos_id = True, 2, 1

    def token_to_id(self, text):
        return self.tokens.index(text) if text in self.tokens else None

    def is_special(self, i):
        return i < len(self.tokens)


class FakeHandle:
    def __init__(self, pieces, ids, interrupt_after=None):
        self._pieces, self.ids, self.interrupt_after = pieces, ids, interrupt_after
        self.done = threading.Event()
        self.output = None
        self.request = SimpleNamespace(metrics=lambda: self._metrics())
        self.cancelled = False

    def _metrics(self):
        n = len("".join(self._pieces))
        return {"ttft_s": 0.01, "decode_tps": 10.0, "prompt_tokens": len(self.ids), "cached_tokens": 16,
                "completion_tokens": n}

    def _end(self, reason):
        self.output = SimpleNamespace(finish_reason=reason, metrics=self._metrics())
        self.done.set()

    def pieces(self):
        for i, p in enumerate(self._pieces):
            if self.interrupt_after is not None and i == self.interrupt_after:
                raise KeyboardInterrupt
            yield p
        self._end("stop")

    def cancel(self):
        self.cancelled = True
        self._end("cancelled")


class FakeLLM:
    def __init__(self, answers=(), ctx_size=4096, interrupt_after=None):
        self.tokenizer = FakeTokenizer()
        self.loaded = SimpleNamespace(metadata={"general.architecture": "gemma3"}, path="fake.gguf")
        self.ctx_size = ctx_size
        self.answers = list(answers)
        self.interrupt_after = interrupt_after
        self.submitted: list[tuple[list[int], SamplingParams]] = []
        self.handles: list[FakeHandle] = []
        self.prewarmed: list[list[int]] = []
        self.capacity = SimpleNamespace(block_size=16)

    @cached_property
    def chat_template(self):
        return ChatTemplate.for_model(self.loaded.metadata, self.tokenizer)

    def render_chat(self, messages, *, add_generation_prompt=True):
        return self.chat_template.render_prompt(messages, add_generation_prompt=add_generation_prompt,
                                                tokenizer_adds_bos=self.tokenizer.add_bos)

    def tokenize(self, text, *, special=True, add_bos=False):
        return ([2] if add_bos else []) + [ord(c) for c in text]

    def prompt_ids(self, text):
        return self.tokenize(text, add_bos=self.tokenizer.add_bos)

    def submit(self, ids, params):
        if params.max_tokens == 1:  # a prewarm
            self.prewarmed.append(ids)
            h = FakeHandle([], ids)
            h._end("length")
            return h
        self.submitted.append((ids, params))
        pieces = self.answers.pop(0) if self.answers else ["ok"]
        h = FakeHandle(pieces, ids, self.interrupt_after)
        self.handles.append(h)
        return h

    def stats(self):
        return {"blocks_total": 10, "blocks_used": 0, "blocks_free": 10, "blocks_cached": 3}


def run_turn(session, user):
    ans = session.ask(user)
    try:
        text = "".join(ans)
    except KeyboardInterrupt:
        text = None
    ans.close()
    return ans, text


def test_next_prompt_extends_previous_prompt_and_answer():
    llm = FakeLLM(answers=[["Hello", " there"], ["Four"]])
    s = ChatSession(llm, system="Be brief.")
    ans, _ = run_turn(s, "Hi")
    assert ans.text == "Hello there" and ans.finish_reason == "stop"
    run_turn(s, "What is 2+2?")
    (p1, _), (p2, _) = llm.submitted
    answer_ids = llm.tokenize("Hello there")
    assert p2[:len(p1) + len(answer_ids)] == p1 + answer_ids  # the prefix tree can serve all of turn 1
    assert p1[0] == 2 and p1[1] != 2  # exactly one BOS: the template's BOS text was stripped
    assert s.messages()[-1] == {"role": "assistant", "content": "Four"}
    # the template's turn-start token stops a base model that writes the next header itself
    assert 3 in llm.submitted[0][1].stop_token_ids


def test_prewarm_prefills_the_start_of_the_next_prompt():
    llm = FakeLLM(answers=[["A"], ["B"]])
    llm.capacity.block_size = 32
    s = ChatSession(llm)
    s.prewarm()
    assert llm.prewarmed == []  # BOS + turn header alone: shorter than a block, nothing to gain
    s.system = "You are a helpful assistant."
    s.prewarm()
    run_turn(s, "Hi")
    s.prewarm()  # e.g. after /load: the whole conversation so far
    run_turn(s, "More")
    (w1, w2), (p1, _), (p2, _) = llm.prewarmed, *llm.submitted
    assert p1[:len(w1)] == w1 and len(w1) > 32 and p2[:len(w2)] == w2 and len(w2) > len(p1)


def test_overflow_drops_oldest_turns_keeps_system_and_says_so():
    notes = []
    llm = FakeLLM(ctx_size=400)
    s = ChatSession(llm, system="SYS", params=SamplingParams(max_tokens=50), notify=notes.append)
    for i in range(6):
        run_turn(s, f"message number {i} " + "x" * 20)
    assert notes and "dropped the oldest" in notes[0] and "system prompt kept" in notes[0]
    assert s.system == "SYS" and len(s.turns) < 6
    assert s.turns[-1].user.startswith("message number 5")
    for ids, params in llm.submitted:
        assert len(ids) + params.max_tokens <= llm.ctx_size
    assert "SYS" in "".join(map(chr, llm.submitted[-1][0][1:]))


def test_message_too_long_for_context():
    notes = []
    s = ChatSession(FakeLLM(ctx_size=120), params=SamplingParams(max_tokens=100), notify=notes.append)
    run_turn(s, "short")  # prompt ~40 chars + 100 > 120: the answer is limited, with a notice
    assert any("answer limited to" in n for n in notes)
    with pytest.raises(ContextOverflowError):
        s.ask("y" * 200)


def test_ctrl_c_keeps_partial_answer_or_drops_an_empty_turn():
    llm = FakeLLM(answers=[["Once", " upon", " a time"]], interrupt_after=2)
    s = ChatSession(llm)
    ans, text = run_turn(s, "Tell me a story")
    assert text is None and ans.interrupted and ans.finish_reason == "cancelled"
    assert llm.handles[0].cancelled
    assert s.turns[-1].user == "Tell me a story" and s.turns[-1].assistant == "Once upon"
    llm.interrupt_after = 0
    run_turn(s, "Again")
    assert len(s.turns) == 1  # nothing was said: the turn is dropped
    assert s.undo() and s.turns == []


def test_set_save_load(tmp_path):
    s = ChatSession(FakeLLM(answers=[["A1"]]), system="Sys")
    s.set_option("temperature", "0.2")
    s.set_option("max-tokens", "7")
    s.set_option("seed", "none")
    assert (s.params.temperature, s.params.max_tokens, s.params.seed) == (0.2, 7, None)
    for name, value in [("top_p", "0"), ("bogus", "1"), ("top_k", "x")]:
        with pytest.raises(InvalidRequestError):
            s.set_option(name, value)
    run_turn(s, "Q1")
    f = tmp_path / "c.json"
    s.save(str(f))
    data = json.loads(f.read_text())
    assert data["messages"] == [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Q1"},
                                {"role": "assistant", "content": "A1"}]
    s2 = ChatSession(FakeLLM())
    s2.load(str(f))
    assert s2.messages() == s.messages()
    f.write_text('[{"role": "user", "content": "dangling"}]')
    with pytest.raises(InvalidRequestError, match="end with an assistant"):
        s2.load(str(f))
    with pytest.raises(InvalidRequestError):
        parse_messages([{"role": "tool", "content": "x"}])


def test_ui_piped_prints_only_answers_and_runs_commands():
    out, err = io.StringIO(), io.StringIO()
    llm = FakeLLM(answers=[["a", "1"], ["a2"]])
    ui = ChatUI(ChatSession(llm), interactive=False, out=out, err=err)
    code = ui.run(["Hi\n", "\n", "/set temperature 0\n", "/nope\n", "//slash\n", "/exit\n", "never\n"])
    assert code == 0
    assert out.getvalue() == "a1\na2\n"
    assert llm.submitted[1][1].temperature == 0
    assert "unknown command /nope" in err.getvalue() and "gemma" in err.getvalue()  # template notice
    assert ui.session.turns[-1].user == "/slash"


def test_ui_interactive_status_line_and_stats():
    out = io.StringIO()
    ui = ChatUI(ChatSession(FakeLLM(answers=[["Yes"]])), interactive=True, out=out, err=io.StringIO(), color=False)
    ui.handle_line("Hi")
    ui.handle_line("/stats")
    text = out.getvalue()
    assert re.search(r"Yes\n\[prefill \d+ new / 16 cached tokens · ttft 0\.01s · 3 tokens at 10\.0 tok/s", text)
    assert "prompt cache" in text and "KV cache" in text


# -- the real command on the default model --------------------------------------------------------------------
def _chat_cmd() -> list[str]:
    from edgellm import cli

    if "chat" in getattr(cli.main, "commands", {}):
        return [sys.executable, "-m", "edgellm.cli", "chat"]
    return [sys.executable, "-m", "edgellm.cli_chat"]  # until the command is registered on the group


@pytest.fixture(scope="module")
def chat_env(default_model, tmp_path_factory):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               EDGELLM_MODEL=default_model, EDGELLM_CACHE=str(tmp_path_factory.mktemp("cache")),
               NO_COLOR="1", TERM="dumb", PYTHONFAULTHANDLER="1")
    return env


COMMON = ["--threads", "2", "--ctx-size", "512", "--temperature", "0"]
SYSTEM = "You are a friendly assistant. You answer every question briefly, clearly and in plain English."
STATUS = re.compile(r"\[(stopped · )?prefill (\d+) new / (\d+) cached tokens[^\]]*\]")


@pytest.mark.slow
def test_chat_in_a_terminal(chat_env):
    # speculation off and a 4096 context: a counting answer filled 512 positions in ~5 s (93 tok/s) in CI before
    # the interrupt landed; now it runs for ~40 s
    child = pexpect.spawn(_chat_cmd()[0], _chat_cmd()[1:] + COMMON + ["--max-tokens", "6", "--system", SYSTEM,
                                                                      "--speculative", "off", "--ctx-size", "4096"],
                          env=chat_env, cwd=str(REPO), encoding="utf-8", timeout=scaled(90), dimensions=(40, 200),
                          preexec_fn=_sigint_default)
    try:
        child.expect_exact(">>> ")
        child.sendline("Hi")
        child.expect(STATUS)
        first = child.match
        child.expect_exact(">>> ")
        child.sendline("What is 2+2?")
        child.expect(STATUS)
        new, cached = int(child.match.group(2)), int(child.match.group(3))
        assert cached > 0 and new < new + cached, child.match.group(0)  # only the new message was prefilled
        assert cached >= int(first.group(2)) + int(first.group(3)) - 16  # all of turn 1, up to a partial block
        answers = child.before
        assert answers.strip(), "no answer text before the status line"
        child.expect_exact(">>> ")
        child.sendline("/reset")
        child.expect_exact("conversation cleared")
        child.expect_exact(">>> ")
        child.sendline("/set max_tokens 3000")
        child.expect_exact(">>> ")
        # a base model may end a story after one line on some hosts (float order differs per ISA); counting goes on
        child.sendline("Count from 1 to 300, separated by commas: 1, 2, 3, 4, 5, 6,")
        child.expect_exact("5, 6,")
        child.expect(r"\d+, \d+, \d+,")  # the answer has begun and is still going
        child.sendintr()
        child.expect(r"\[stopped")
        child.expect_exact(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    except pexpect.TIMEOUT:
        pytest.fail("the chat went silent; its threads:\n" + _stacks(child), pytrace=False)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def _sigint_default() -> None:
    """In the child before exec: Ctrl-C as a terminal's foreground program gets it. A suite started as a background
    job of a non-interactive shell (`bash .ci/run &`) inherits SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler: the chat never saw the Ctrl-C and went on answering (the failure report showed
    SIGINT missing from every thread's caught signals)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stacks(child) -> str:
    """What a silent chat process was doing: each thread's state and signal masks (SigCgt without SIGINT's bit 0x2
    is how an inherited ignored SIGINT showed), then every thread's Python stack (SIGABRT: faulthandler)."""
    report = []
    for task in sorted(Path(f"/proc/{child.pid}/task").glob("*")):  # each thread's name and signal state
        try:
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        report.append(f"{task.name} {status['Name'].strip()}: " + ", ".join(
            f"{k} {status[k].strip()}" for k in ("State", "SigPnd", "ShdPnd", "SigBlk", "SigCgt") if k in status))
    child.kill(signal.SIGABRT)
    try:
        child.expect(pexpect.EOF, timeout=scaled(30))
    except pexpect.TIMEOUT:
        pass
    return "\n".join(report) + "\n" + child.before[-20000:]


@pytest.mark.slow
def test_chat_reads_turns_from_a_pipe(chat_env):
    cmd = _chat_cmd() + COMMON + ["--max-tokens", "6"]
    one = subprocess.run(cmd, input="Hi\n", capture_output=True, text=True, env=chat_env, cwd=REPO, timeout=scaled(120))
    two = subprocess.run(cmd, input="Hi\nWhat is 2+2?\n", capture_output=True, text=True, env=chat_env, cwd=REPO,
                         timeout=scaled(120))
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert one.stdout.endswith("\n") and len(one.stdout) > 1
    # the same first answer (greedy), then a second answer and its newline
    assert two.stdout.startswith(one.stdout) and len(two.stdout) > len(one.stdout) + 1 and two.stdout.endswith("\n")
    assert "Traceback" not in two.stderr
