"""Programs over an LLM, in the style of SGLang's frontend: a function builds a prompt step by step on a state `s`.

    @edgellm.program
    def qa(s, question):
        s += system("Answer briefly.")
        s += user(question)
        s += assistant(gen("answer", max_tokens=32, stop="\\n"))
        s += "Confidence: " + select("conf", choices=["high", "low"])

    state = qa.run(question="Why is the sky blue?", backend=llm)   # llm: an edgellm.LLM or an OpenAIBackend
    state["answer"], state["conf"], state.text()

`s += ...` queues the step on the state's own worker thread and returns at once; reading a variable, the text or
forking waits for the queued steps. So `s.fork(n)` branches and `run_batch` inputs run concurrently and the engine
batches them, sharing their common prefix through the prefix tree. `select` scores every choice by the sum of the
model's log-probabilities of its tokens given the prefix (in-process: the tokens are forced through the engine with
logprobs on; OpenAI backend: a grammar-constrained choice, no scores).
"""
from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

# -- expressions ---------------------------------------------------------------------------------------------------


class Expr:
    """A step of a program: text, a role block, a generation or a selection; `+` chains steps."""

    def __add__(self, other) -> "Concat":
        return Concat([self, other])

    def __radd__(self, other) -> "Concat":
        return Concat([other, self])


@dataclass
class Concat(Expr):
    parts: list


@dataclass
class Role(Expr):
    role: str
    content: Any = None  # str, Expr, or None (then the role is opened and closed around nothing)


@dataclass
class Gen(Expr):
    name: str | None
    max_tokens: int = 64
    stop: list[str] | str | None = None
    temperature: float = 0.0
    regex: str | None = None
    json_schema: Any = None
    seed: int | None = None


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str] = field(default_factory=list)


def gen(name: str | None = None, *, max_tokens: int = 64, stop: list[str] | str | None = None,
        temperature: float = 0.0, regex: str | None = None, json_schema: Any = None, seed: int | None = None) -> Gen:
    """Generate text into variable `name` (greedy by default; `regex` / `json_schema` constrain it)."""
    return Gen(name, max_tokens, stop, temperature, regex, json_schema, seed)


def select(name: str | None = None, *, choices: list[str]) -> Select:
    """Append the choice the model finds most likely after the prefix; stored in variable `name`."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        from edgellm.errors import InvalidRequestError

        raise InvalidRequestError("select needs a non-empty list of non-empty strings")
    return Select(name, list(choices))


def system(content=None) -> Role:
    return Role("system", content)


def user(content=None) -> Role:
    return Role("user", content)


def assistant(content=None) -> Role:
    return Role("assistant", content)


_MARK, _OTHER = "\x00EDGELLM\x00", "\x00OTHER\x00"  # stand-in contents that no template produces itself

# -- backends ------------------------------------------------------------------------------------------------------
class LLMBackend:
    """Runs programs in-process on an edgellm.LLM; roles are rendered with the model's chat template.

    A role's marks (the text before and after its content) are read off the template by rendering a message of
    that role where the template accepts one: a user or system message first, an assistant message after a user
    message. A template that folds the system prompt into the first user turn (Gemma) gets the system text first,
    followed by the separator the template puts between it and the user's message. A template that cannot
    render a role raises InvalidRequestError naming the role and the template."""

    def __init__(self, llm):
        self.llm = llm
        self._roles: dict[str, tuple[str, str]] = {}

    def role_marks(self, role: str) -> tuple[str, str]:
        """(prefix, suffix) of one message of `role` in the model's chat template (BOS stripped)."""
        if role not in self._roles:
            self._roles[role] = self._marks(role)
        return self._roles[role]

    def _marks(self, role: str) -> tuple[str, str]:
        from edgellm.errors import InvalidRequestError

        render = lambda msgs: self.llm.render_chat(msgs, add_generation_prompt=False)  # noqa: E731
        before = [] if role in ("system", "user") else [{"role": "user", "content": _OTHER}]
        head = render(before) if before else ""
        text = render(before + [{"role": role, "content": _MARK}])
        if text.startswith(head) and text.count(_MARK) == 1:
            pre, post = text[len(head):].split(_MARK)
            return pre, post
        if role == "system":  # folded into the first user turn: the system text, then the template's separator
            text = render([{"role": "system", "content": _MARK}, {"role": "user", "content": _OTHER}])
            i, j = text.find(_MARK), text.find(_OTHER)
            if 0 <= i < j:
                return "", text[i + len(_MARK):j]
        raise InvalidRequestError(f"the chat template {self.llm.chat_template.name!r} cannot render a lone "
                                  f"{role!r} message as a program step")

    def cache_prefix(self, text: str) -> None:
        """Prefill `text` (one greedy token) so its full KV blocks enter the prefix tree before branches start
        (concurrent branches admitted in one step would otherwise each compute it: nothing is in the tree yet)."""
        from edgellm.sampling import SamplingParams

        self.llm.generate(text, SamplingParams(max_tokens=1, temperature=0.0))

    def generate(self, state: "ProgramState", g: Gen) -> str:
        from edgellm.sampling import SamplingParams

        stop = [g.stop] if isinstance(g.stop, str) else list(g.stop or [])
        params = SamplingParams(max_tokens=g.max_tokens, temperature=g.temperature, stop=stop, seed=g.seed,
                                regex=g.regex, json_schema=g.json_schema)
        return self.llm.generate(state.text_now(), params).text

    def score(self, prefix: str, choices: list[str]) -> tuple[list[int], list[list[int]], list[float]]:
        """(context ids, scored ids per choice, sum of log-probs per choice): each choice's tokens after the
        longest token prefix all choices share with the prompt, forced through the engine with logprobs on."""
        from edgellm.sampling import SamplingParams
        from edgellm.structured import TokenSequence

        llm = self.llm
        base = llm.prompt_ids(prefix)
        fulls = [llm.prompt_ids(prefix + c) for c in choices]

        def common(a, b):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            return n

        k = min(min(common(base, f) for f in fulls), len(base))
        k = min(k, min(len(f) - 1 for f in fulls))  # every choice keeps at least one token to score
        k = max(k, 1)
        ctx = base[:k]
        handles = []
        for f in fulls:
            p = SamplingParams(max_tokens=len(f) - k, temperature=0.0, logprobs=0, ignore_eos=True)
            p.compiled_grammar = TokenSequence(f[k:])
            handles.append(llm.submit(ctx, p))
        scores = []
        for c, h, f in zip(choices, handles, fulls):
            out = h.result()
            if out.token_ids != f[k:]:  # e.g. cut by the context: the score would be of another text
                from edgellm.errors import ContextOverflowError

                raise ContextOverflowError(f"select: choice {c!r} could not be scored: {len(out.token_ids)} of its "
                                           f"{len(f) - k} tokens were produced (finish_reason "
                                           f"{out.finish_reason!r})")
            scores.append(float(sum(lp for lp, _ in h.request.logprobs)))
        return ctx, [f[k:] for f in fulls], scores

    def select(self, state: "ProgramState", s: Select) -> tuple[int, list[float]]:
        _, _, scores = self.score(state.text_now(), s.choices)
        return max(range(len(scores)), key=scores.__getitem__), scores


class OpenAIBackend:
    """Runs programs against an OpenAI-compatible server with the `openai` client: chat/completions when the
    program uses roles, completions otherwise. Constraints go as llama.cpp-style `grammar` (edgellm, llama.cpp)."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None, model: str | None = None,
                 client=None):
        if client is None:
            import openai

            client = openai.OpenAI(base_url=base_url, api_key=api_key or "none")
        self.client = client
        self._model = model

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.client.models.list().data[0].id
        return self._model

    def role_marks(self, role: str) -> tuple[str, str]:
        return "", ""

    def _ask(self, state: "ProgramState", *, max_tokens: int, temperature: float, stop=None, grammar=None,
             json_schema=None, seed=None) -> str:
        extra = {}
        if grammar is not None:
            extra["grammar"] = grammar
        if json_schema is not None:
            extra["json_schema"] = json_schema if isinstance(json_schema, dict) else {"type": "object"}
        kw = dict(model=self.model, max_tokens=max_tokens, temperature=temperature, stop=stop or None, seed=seed,
                  extra_body=extra or None)
        msgs = state.messages_now()
        if msgs:
            r = self.client.chat.completions.create(messages=msgs, **kw)
            return r.choices[0].message.content or ""
        r = self.client.completions.create(prompt=state.text_now(), **kw)
        return r.choices[0].text

    def generate(self, state: "ProgramState", g: Gen) -> str:
        grammar = None if g.regex is None else "start: /" + g.regex.replace("/", "\\/") + "/"
        return self._ask(state, max_tokens=g.max_tokens, temperature=g.temperature, stop=g.stop, grammar=grammar,
                         json_schema=g.json_schema, seed=g.seed)

    def select(self, state: "ProgramState", s: Select) -> tuple[int, list[float] | None]:
        import json

        out = self._ask(state, max_tokens=max(len(c) for c in s.choices) + 4, temperature=0.0,
                        grammar="start: " + " | ".join(json.dumps(c) for c in s.choices))
        return (s.choices.index(out) if out in s.choices else 0), None


def as_backend(backend):
    if backend is None:
        backend = _default_backend
    if backend is None:
        raise ValueError("no backend: pass backend=LLM(...) or OpenAIBackend(...), or call set_default_backend")
    if hasattr(backend, "engine") and hasattr(backend, "generate"):  # an edgellm.LLM
        return LLMBackend(backend)
    return backend


_default_backend = None


def set_default_backend(backend) -> None:
    global _default_backend
    _default_backend = as_backend(backend)


# -- state ---------------------------------------------------------------------------------------------------------
class ProgramState:
    """The prompt built so far, the variables and the queued steps. `s += expr` queues; reads wait."""

    def __init__(self, backend, *, runs: "list[ProgramState] | None" = None):
        """runs: the states of the run this one belongs to (a fork's parent's; None: a new run)."""
        self.backend = backend
        self._text = ""  # the prompt as the model sees it (role marks included for in-process backends)
        self._messages: list[dict] = []  # closed role messages (for chat APIs)
        self._open: list[Any] = [None, ""]  # the open role and its content so far
        self.vars: dict[str, Any] = {}
        self.scores: dict[str, list[float] | None] = {}  # select name -> per-choice log-prob sums
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="edgellm-program")
        self._pending: list[Future] = []
        self._all = [] if runs is None else runs
        self._all.append(self)

    # queued execution
    def __iadd__(self, expr) -> "ProgramState":
        self._pending.append(self._pool.submit(self._exec, expr))
        return self

    def sync(self) -> "ProgramState":
        """Wait for the queued steps (re-raising their errors)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()
        return self

    def __getitem__(self, name: str):
        return self.sync().vars[name]

    def sync_all(self) -> "ProgramState":
        """Wait for the queued steps of this state and of every state forked from the same run."""
        for st in list(self._all):
            st.sync()
        return self

    def text(self) -> str:
        return self.sync().text_now()

    def messages(self) -> list[dict]:
        return self.sync().messages_now()

    def fork(self, n: int) -> list["ProgramState"]:
        """n copies of this state (after its queued steps) that continue independently and concurrently."""
        self.sync()
        if n > 1 and hasattr(self.backend, "cache_prefix"):
            self.backend.cache_prefix(self._text)  # so every branch finds the shared prefix in the tree
        return [self._copy() for _ in range(n)]

    def _copy(self) -> "ProgramState":
        """A new state of the same run with this one's prompt, messages and variables."""
        c = ProgramState(self.backend, runs=self._all)
        c._text, c._messages, c._open = self._text, [dict(m) for m in self._messages], list(self._open)
        c.vars, c.scores = dict(self.vars), dict(self.scores)
        return c

    # views used by backends (from the state's worker thread)
    def text_now(self) -> str:
        return self._text

    def messages_now(self) -> list[dict]:
        msgs = list(self._messages)
        role, content = self._open
        if role is not None and role != "assistant":
            msgs.append({"role": role, "content": content})
        return msgs

    # the interpreter
    def _append(self, text: str) -> None:
        self._text += text
        if self._open[0] is not None:
            self._open[1] += text

    def _exec(self, expr) -> None:
        if expr is None:
            return
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, Concat):
            for p in expr.parts:
                self._exec(p)
        elif isinstance(expr, Role):
            pre, post = self.backend.role_marks(expr.role)
            self._append(pre)
            self._open = [expr.role, ""]
            self._exec(expr.content)
            self._messages.append({"role": expr.role, "content": self._open[1]})
            self._open = [None, ""]
            self._append(post)
        elif isinstance(expr, Gen):
            out = self.backend.generate(self, expr)
            self._append(out)
            if expr.name:
                self.vars[expr.name] = out
        elif isinstance(expr, Select):
            i, scores = self.backend.select(self, expr)
            self._append(expr.choices[i])
            if expr.name:
                self.vars[expr.name] = expr.choices[i]
                self.scores[expr.name] = scores
        else:
            raise TypeError(f"cannot add {type(expr).__name__} to a program state")

    def stop_worker(self) -> None:
        """Stop this state's worker thread (its queued steps still finish)."""
        self._pool.shutdown(wait=False)

    def close(self) -> None:
        """Stop the worker threads of every state of this run (queued steps still finish)."""
        for s in self._all:
            s.stop_worker()


class Program:
    """A function over a ProgramState; run it once (`run`) or over many inputs concurrently (`run_batch`)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, *args, backend=None, **kwargs) -> ProgramState:
        s = ProgramState(as_backend(backend))
        try:
            self.fn(s, *args, **kwargs)
            s.sync_all()
        finally:
            s.close()
        return s

    __call__ = run

    def run_batch(self, inputs: list[dict], *, backend=None, num_threads: int = 8) -> list[ProgramState]:
        """Run the program once per input dict (keyword arguments), up to num_threads at a time."""
        b = as_backend(backend)
        with ThreadPoolExecutor(num_threads, thread_name_prefix="edgellm-batch") as pool:
            return list(pool.map(lambda kw: self.run(backend=b, **kw), inputs))


def program(fn: Callable) -> Program:
    """Decorator: turn `fn(s, ...)` into a Program."""
    return Program(fn)


class _CallableModule(__import__("types").ModuleType):
    """`edgellm.program` is both this module and the decorator: importing the submodule rebinds the package's
    `program` attribute to the module, so the module itself decorates."""

    def __call__(self, fn: Callable) -> Program:
        return program(fn)


__import__("sys").modules[__name__].__class__ = _CallableModule
