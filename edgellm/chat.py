"""Terminal chat: a conversation kept in the engine's prefix cache (ChatSession; the line UI is chat_ui.py).

Each turn's prompt is the chat template rendered over the whole conversation. The answer is stored as the text
the model generated, so the next rendering starts with exactly the tokens of the previous prompt + answer and the
prefix tree serves them from the KV cache: only the new user message is prefilled.

Ctrl-C during an answer stops it and keeps the partial answer in the history (an answer stopped before its first
piece drops the whole turn); /undo removes the last turn. When the conversation outgrows the context, the oldest
turns are dropped (the system prompt stays) with a notice.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from edgellm.errors import ContextOverflowError, EdgeLLMError, InvalidRequestError
from edgellm.sampling import SamplingParams

SAVE_FORMAT = "edgellm-chat/1"
# A base model that writes the next turn's header has finished its answer: stop on it (when it is a token).
TURN_START_TOKENS = ("<start_of_turn>", "<|im_start|>", "<|start_header_id|>", "<|user|>", "[INST]")
# When the context is full, drop turns until this fraction of it is free again, so the next turns keep a stable
# prefix (cache hits) instead of dropping one turn -- and re-prefilling everything -- every time.
DROP_HEADROOM = 0.25


def _seed(v: str) -> int | None:
    return None if v.lower() in ("none", "random", "-") else int(v)


# /set NAME VALUE: the sampling options a user may change, with their parsers.
SETTABLE: dict[str, Callable[[str], object]] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int,
    "seed": _seed, "repeat_penalty": float,
}


@dataclass
class Turn:
    """One user message and the model's answer (possibly partial)."""

    user: str
    assistant: str
    interrupted: bool = False


@dataclass
class SessionTotals:
    """Counters over the whole session, for /stats."""

    answers: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    decode_s: float = 0.0
    last: dict = field(default_factory=dict)  # metrics of the last answer

    def add(self, m: dict) -> None:
        self.answers += 1
        self.prompt_tokens += m.get("prompt_tokens", 0)
        self.cached_tokens += m.get("cached_tokens", 0)
        self.completion_tokens += m.get("completion_tokens", 0)
        if m.get("decode_tps"):
            self.decode_s += max(m.get("completion_tokens", 0) - 1, 0) / m["decode_tps"]
        self.last = dict(m)


class Answer:
    """An answer being generated: iterate for its text pieces; ``close()`` stops it early.

    The turn enters the history when the iteration ends or is closed. Afterwards ``text``, ``finish_reason``
    ("stop" | "length" | "cancelled"), ``metrics`` (the request's) and ``interrupted`` are set."""

    def __init__(self, session: "ChatSession", user: str, handle):
        self.session, self.user, self._handle = session, user, handle
        self.text = ""
        self.finish_reason: str | None = None
        self.metrics: dict = {}
        self.interrupted = False
        self._gen = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._gen

    def close(self) -> None:
        """Stop generating (if still running) and record the turn."""
        self._gen.close()
        if self.finish_reason is None:  # closed before the first next(): the generator body never ran
            self._finish()

    def _run(self) -> Iterator[str]:
        try:
            for piece in self._handle.pieces():
                self.text += piece
                yield piece
        finally:
            self._finish()

    def _finish(self) -> None:
        if self.finish_reason is not None:
            return
        h = self._handle
        if not h.done.is_set():
            self.interrupted = True
            h.cancel()
        h.done.wait(timeout=10)  # its blocks go back to the prefix tree before the next turn is admitted
        out = h.output
        self.finish_reason = "cancelled" if self.interrupted else (out.finish_reason if out else None)
        self.metrics = dict(out.metrics) if out else h.request.metrics()
        self.session.record(self)


class ChatSession:
    """A conversation with one loaded model: history, system prompt, sampling options, prompt building.

    No terminal I/O here: ``notify`` receives one-line notices (template fallback, dropped turns)."""

    def __init__(self, llm, *, system: str | None = None, params: SamplingParams | None = None,
                 notify: Callable[[str], None] | None = None):
        self.llm = llm
        self.system = system or None
        self.params = params or SamplingParams()
        self.turns: list[Turn] = []
        self.totals = SessionTotals()
        self._prewarm = None  # handle of a background prefill of the conversation so far
        self.notify = notify or (lambda msg: None)
        tok = llm.tokenizer
        self.template = llm.chat_template
        ids = (tok.token_to_id(t) for t in TURN_START_TOKENS)
        self.turn_stop_ids = sorted({i for i in ids if i is not None and tok.is_special(i)})

    # -- conversation -----------------------------------------------------------------------------
    def messages(self, user: str | None = None) -> list[dict]:
        """The conversation as chat messages (system first if set), plus ``user`` as the next message."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns:
            msgs += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant}]
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs

    def reset(self) -> None:
        """Forget every turn (the system prompt stays)."""
        self.turns.clear()

    def undo(self) -> Turn | None:
        """Remove and return the last turn (None if there is none)."""
        return self.turns.pop() if self.turns else None

    def set_option(self, name: str, value: str) -> None:
        """Change one sampling option from its text form; raises InvalidRequestError on a bad name or value."""
        name = name.replace("-", "_").lower()
        if name not in SETTABLE:
            raise InvalidRequestError(f"unknown option {name!r}; one of: {', '.join(SETTABLE)}")
        try:
            v = SETTABLE[name](value)
        except ValueError:
            raise InvalidRequestError(f"{name}: not a valid value: {value!r}") from None
        self.params = replace(self.params, **{name: v})  # validates

    def options(self) -> dict:
        """The settable sampling options and their current values."""
        return {k: getattr(self.params, k) for k in SETTABLE}

    # -- files ------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": SAVE_FORMAT, "model": str(getattr(self.llm.loaded, "path", "")),
                "messages": self.messages(), "sampling": self.options()}

    def save(self, path: str) -> None:
        """Write the conversation as JSON ({"messages": [...], ...}); raises InvalidRequestError on failure."""
        try:
            with open(os.path.expanduser(path), "w", encoding="utf-8") as f:
                json.dump(self.to_json(), f, ensure_ascii=False, indent=1)
                f.write("\n")
        except OSError as e:
            raise InvalidRequestError(f"cannot save to {path}: {e.strerror or e}") from None

    def load(self, path: str) -> None:
        """Replace the conversation (system prompt and turns) with a saved one: a JSON object with "messages",
        or a bare list of messages. Sampling options are not changed."""
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise InvalidRequestError(f"cannot read {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{path} is not JSON: {e.msg} at line {e.lineno}") from None
        self.system, self.turns = parse_messages(data.get("messages") if isinstance(data, dict) else data, path)

    # -- prompts ----------------------------------------------------------------------------------
    def render_ids(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation (exactly one BOS when the model wants one)."""
        return self.llm.prompt_ids(self.llm.render_chat(messages, add_generation_prompt=add_generation_prompt))

    def prepare(self, user: str) -> tuple[list[int], SamplingParams]:
        """Prompt ids and sampling params for the next turn; drops the oldest turns if the context is short.

        Raises ContextOverflowError if the message cannot fit even alone."""
        ctx, want = self.llm.ctx_size, self.params.max_tokens
        ids = self.render_ids(self.messages(user))
        if len(ids) + want > ctx and self.turns:
            target = max(ctx - want - int(ctx * DROP_HEADROOM), 0)
            dropped = 0
            while self.turns and len(ids) > target:
                self.turns.pop(0)
                dropped += 1
                ids = self.render_ids(self.messages(user))
            self.notify(f"context full ({ctx} tokens): dropped the oldest {plural(dropped, 'turn')}"
                        f"{' (system prompt kept)' if self.system else ''}; {plural(len(self.turns), 'earlier turn')}"
                        f" kept")
        params = self.params
        if len(ids) + want > ctx:
            room = ctx - len(ids)
            if room < 1:
                raise ContextOverflowError(f"this message needs {len(ids)} prompt tokens but the context holds "
                                           f"{ctx}; shorten it or restart with a larger --ctx-size")
            self.notify(f"answer limited to {room} tokens by the context ({ctx} tokens)")
            params = replace(params, max_tokens=room)
        if self.turn_stop_ids:
            params = replace(params, stop_token_ids=sorted(set(params.stop_token_ids) | set(self.turn_stop_ids)))
        return ids, params

    def ask(self, user: str) -> Answer:
        """Start answering ``user``; iterate the returned Answer for text pieces."""
        ids, params = self.prepare(user)
        self._wait_prewarm()
        return Answer(self, user, self.llm.submit(ids, params))

    def prewarm(self) -> None:
        """Prefill the conversation so far (BOS, system prompt, earlier turns) in the background, so the next
        answer only prefills the user's new message: at start, after /system and after /load. Does nothing if
        that prefix is shorter than one KV block."""
        marker = "\ue000"  # a private-use character: where the user's next message would begin
        try:
            text = self.llm.render_chat(self.messages(marker), add_generation_prompt=False)
        except EdgeLLMError:
            return
        cut = text.find(marker)
        if cut <= 0:
            return
        ids = self.llm.prompt_ids(text[:cut])
        if len(ids) > self.llm.capacity.block_size and len(ids) + 1 < self.llm.ctx_size:
            self._prewarm = self.llm.submit(ids, SamplingParams(max_tokens=1, temperature=0))

    def _wait_prewarm(self) -> None:
        # Computing the same prefix twice side by side is slower than letting the prewarm finish and reusing it.
        h, self._prewarm = self._prewarm, None
        if h is not None:
            h.done.wait(timeout=60)

    def record(self, ans: Answer) -> None:
        """Add a finished (or stopped) answer to the history and the totals (Answer calls it once)."""
        if ans.interrupted and not ans.text:
            return  # stopped before it said anything: the turn is dropped
        self.turns.append(Turn(ans.user, ans.text, ans.interrupted))
        self.totals.add(ans.metrics)

    # -- numbers ----------------------------------------------------------------------------------
    def kv_use(self) -> float:
        """Fraction of the KV cache holding tokens (in use by a request or cached in the prefix tree)."""
        s = self.llm.stats()
        return (s["blocks_used"] + s["blocks_cached"]) / max(s["blocks_total"], 1)

    def status_line(self, ans: Answer) -> str:
        """``[prefill 23 new / 180 cached tokens · ttft 0.21s · 41 tokens at 41.2 tok/s · ctx 203/4096 · KV 12%]``."""
        m = ans.metrics
        n_prompt, cached, n_out = m.get("prompt_tokens", 0), m.get("cached_tokens", 0), m.get("completion_tokens", 0)
        parts = ["stopped"] if ans.interrupted else []
        parts.append(f"prefill {n_prompt - cached} new / {cached} cached tokens")
        if m.get("ttft_s") is not None:
            parts.append(f"ttft {m['ttft_s']:.2f}s")
        parts.append(f"{n_out} tokens at {m.get('decode_tps') or 0.0:.1f} tok/s")
        parts.append(f"ctx {n_prompt + n_out}/{self.llm.ctx_size}")
        parts.append(f"KV {self.kv_use():.0%}")
        if ans.finish_reason == "length" and n_out:
            parts.append("cut at max_tokens")
        return "[" + " · ".join(parts) + "]"

    def stats_text(self) -> str:
        """Multi-line /stats report."""
        t, s = self.totals, self.llm.stats()
        last = t.last
        lines = [f"turns in history  {len(self.turns)}"]
        if last:
            lines.append(f"last answer       {last.get('completion_tokens', 0)} tokens · ttft "
                         f"{last.get('ttft_s') or 0:.2f}s · {last.get('decode_tps') or 0:.1f} tok/s")
            lines.append(f"last prefill      {last['prompt_tokens'] - last['cached_tokens']} new / "
                         f"{last['cached_tokens']} cached tokens")
            lines.append(f"context           {last['prompt_tokens'] + last.get('completion_tokens', 0)} / "
                         f"{self.llm.ctx_size} tokens")
        avg = (t.completion_tokens - t.answers) / t.decode_s if t.decode_s > 0 else 0.0
        share = t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0
        lines.append(f"session           {t.answers} answers · {t.completion_tokens} tokens generated · "
                     f"{avg:.1f} tok/s average")
        lines.append(f"prompt cache      {t.cached_tokens} of {t.prompt_tokens} prompt tokens reused ({share:.0%})")
        bs = self.llm.capacity.block_size
        empty = s["blocks_free"] - s["blocks_cached"]  # the pool counts cached blocks as free (evictable)
        lines.append(f"KV cache          {self.kv_use():.0%} · {s['blocks_used']} in use, {s['blocks_cached']} cached, "
                     f"{empty} empty of {s['blocks_total']} blocks ({bs} tokens each)")
        lines.append("sampling          " + " ".join(f"{k}={v}" for k, v in self.options().items()))
        return "\n".join(lines)


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def parse_messages(msgs, where: str = "conversation") -> tuple[str | None, list[Turn]]:
    """(system, turns) of a message list: an optional system message, then user/assistant pairs."""
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                              and m.get("role") in ("system", "user", "assistant") for m in msgs):
        raise InvalidRequestError(f"{where}: expected a list of {{'role': system|user|assistant, 'content': str}}")
    system = None
    if msgs and msgs[0]["role"] == "system":
        system, msgs = msgs[0]["content"] or None, msgs[1:]
    roles = [m["role"] for m in msgs]
    if roles != ["user", "assistant"] * (len(roles) // 2) or len(roles) % 2:
        raise InvalidRequestError(f"{where}: after the system message, roles must alternate user/assistant "
                                  f"and end with an assistant message")
    return system, [Turn(msgs[i]["content"], msgs[i + 1]["content"]) for i in range(0, len(msgs), 2)]
