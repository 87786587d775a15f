"""The line UI of `edgellm chat` (ChatUI): reads messages and /commands, streams answers, prints status lines.
The conversation logic lives in edgellm/chat.py (ChatSession)."""
from __future__ import annotations

import os
import sys
from typing import Callable, Iterable, TextIO

from edgellm.chat import ChatSession, plural
from edgellm.errors import EdgeLLMError, InvalidRequestError
from edgellm.model_kind import base_model_notice

HELP = """\
Type a message and press Enter; end a line with \\ to continue it on the next one.
Ctrl-C stops an answer (the partial answer stays in the history); Ctrl-D or /exit quits.
  /reset              forget the conversation (keeps the system prompt)
  /undo               remove the last turn
  /system [TEXT]      show or set the system prompt (/system --clear removes it)
  /set [NAME VALUE]   show or set a sampling option: temperature top_p top_k min_p max_tokens seed repeat_penalty
  /save FILE          save the conversation as JSON
  /load FILE          load a conversation saved with /save (or a JSON list of messages)
  /stats              speed, prompt-cache reuse and KV cache use
  /help               this text
  //text              send a message that starts with /"""


class _Exit(Exception):
    pass


class ChatUI:
    """The line-oriented front end: reads messages and commands, streams answers, prints status lines.

    interactive=True: a prompt with readline editing and history; status lines and notices on ``out``.
    interactive=False (stdin is not a terminal): one turn per input line; only answers on ``out``, each followed
    by a newline; notices on ``err``."""

    def __init__(self, session: ChatSession, *, interactive: bool, out: TextIO | None = None,
                 err: TextIO | None = None, color: bool | None = None, history_file: str | None = None):
        self.session, self.interactive = session, interactive
        self.out, self.err = out or sys.stdout, err or sys.stderr
        if color is None:
            color = interactive and self.out.isatty() and not os.environ.get("NO_COLOR") \
                and os.environ.get("TERM") != "dumb"
        self.color = color
        self.history_file = history_file
        self._readline = None
        session.notify = self.notice
        self.commands: dict[str, Callable[[str], None]] = {
            "exit": self._cmd_exit, "quit": self._cmd_exit, "reset": self._cmd_reset, "undo": self._cmd_undo,
            "system": self._cmd_system, "set": self._cmd_set, "save": self._cmd_save, "load": self._cmd_load,
            "stats": self._cmd_stats, "help": self._cmd_help,
        }

    # -- output -----------------------------------------------------------------------------------
    def _style(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def info(self, text: str) -> None:
        """Command output and status lines: the terminal when interactive, else stderr."""
        stream = self.out if self.interactive else self.err
        stream.write(self._style(text, "2") + "\n")
        stream.flush()

    def notice(self, text: str) -> None:
        self.info(f"note: {text}")

    def model_notice(self) -> str | None:
        """The one line said before the chat starts: that the model is a base model and what to pull instead
        (edgellm/model_kind.py), else the template's notice (a built-in template stands in), else None."""
        loaded = self.session.llm.loaded
        name = str(loaded.metadata.get("general.name") or os.path.basename(str(loaded.path)))
        return base_model_notice(loaded.metadata, name) or self.session.template.notice

    def error(self, text: str) -> None:
        stream = self.out if self.interactive else self.err
        stream.write(self._style(f"error: {text}", "31") + "\n")
        stream.flush()

    # -- main loop --------------------------------------------------------------------------------
    def run(self, lines: Iterable[str] | None = None) -> int:
        """Chat until end of input or /exit; returns the exit code. ``lines``: input when not interactive
        (default: stdin)."""
        first = self.model_notice()
        if first:
            self.notice(first)
        if self.interactive:
            self._setup_readline()
            try:
                return self._run_interactive()
            finally:
                self._save_history()
        for line in (sys.stdin if lines is None else lines):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                if self.handle_line(line):
                    self.out.write("\n")
                    self.out.flush()
            except _Exit:
                break
        return 0

    def _run_interactive(self) -> int:
        self.session.prewarm()
        while True:
            try:
                line = self._read_message()
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\n")
                self.info("(Ctrl-D or /exit to quit)")
                continue
            try:
                self.handle_line(line)
            except _Exit:
                return 0
            except EdgeLLMError as e:
                self.error(str(e))
            except KeyboardInterrupt:  # outside the answer's own handling (e.g. while waiting to start)
                self.out.write("\n")
                self.info("[stopped]")

    def _read_message(self) -> str:
        prompt = self._prompt(">>> ", "1;32")
        line = input(prompt)
        while line.endswith("\\"):
            line = line[:-1] + "\n" + input(self._prompt("... ", "2"))
        return line

    def _prompt(self, text: str, code: str) -> str:
        if not self.color:
            return text
        # \001 / \002 tell readline the escape codes take no room on the line
        return f"\001\x1b[{code}m\002{text}\001\x1b[0m\002"

    def handle_line(self, line: str) -> bool:
        """One input line: a /command or a message. Returns True if an answer was printed."""
        if not line.strip():
            return False
        if line.startswith("/") and not line.startswith("//"):
            name, _, arg = line[1:].strip().partition(" ")
            fn = self.commands.get(name.lower())
            if fn is None:
                self.error(f"unknown command /{name}; /help lists them")
                return False
            try:
                fn(arg.strip())
            except InvalidRequestError as e:
                self.error(str(e))
            return False
        if line.startswith("//"):
            line = line[1:]
        self.answer(line)
        return True

    def answer(self, user: str) -> None:
        """Stream the answer to ``user``; Ctrl-C (interactive) stops it."""
        ans = self.session.ask(user)
        out = self.out
        try:
            for piece in ans:
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            if not self.interactive:
                raise
        finally:
            ans.close()
        if self.interactive:
            if not ans.text.endswith("\n"):
                out.write("\n")
            if ans.interrupted and not ans.text:
                self.info("[stopped before the answer began; the message was dropped]")
            else:
                self.info(self.session.status_line(ans))
        elif self.err.isatty():
            self.err.write(self.session.status_line(ans) + "\n")

    # -- commands ---------------------------------------------------------------------------------
    def _cmd_exit(self, arg: str) -> None:
        raise _Exit

    def _cmd_reset(self, arg: str) -> None:
        self.session.reset()
        self.info("conversation cleared" + (" (system prompt kept)" if self.session.system else ""))

    def _cmd_undo(self, arg: str) -> None:
        t = self.session.undo()
        self.info("removed the last turn" if t else "nothing to undo")

    def _cmd_system(self, arg: str) -> None:
        s = self.session
        if not arg:
            self.info(f"system prompt: {s.system!r}" if s.system else "no system prompt")
            return
        s.system = None if arg == "--clear" else arg
        self.info("system prompt removed" if s.system is None else "system prompt set")
        if self.interactive:
            s.prewarm()

    def _cmd_set(self, arg: str) -> None:
        parts = arg.split()
        if not parts:
            self.info(" ".join(f"{k}={v}" for k, v in self.session.options().items()))
            return
        if len(parts) != 2:
            raise InvalidRequestError("usage: /set NAME VALUE (e.g. /set temperature 0.2)")
        self.session.set_option(*parts)
        name = parts[0].replace("-", "_").lower()
        self.info(f"{name} = {self.session.options()[name]}")

    def _cmd_save(self, arg: str) -> None:
        if not arg:
            raise InvalidRequestError("usage: /save FILE")
        self.session.save(arg)
        self.info(f"saved {plural(len(self.session.turns), 'turn')} to {arg}")

    def _cmd_load(self, arg: str) -> None:
        if not arg:
            raise InvalidRequestError("usage: /load FILE")
        self.session.load(arg)
        self.info(f"loaded {plural(len(self.session.turns), 'turn')} from {arg}"
                  + (" (with a system prompt)" if self.session.system else ""))
        if self.interactive:
            self.session.prewarm()

    def _cmd_stats(self, arg: str) -> None:
        self.info(self.session.stats_text())

    def _cmd_help(self, arg: str) -> None:
        self.info(HELP)

    # -- readline ---------------------------------------------------------------------------------
    def _setup_readline(self) -> None:
        try:
            import readline
        except ImportError:  # e.g. Windows without pyreadline: plain input() still works
            return
        self._readline = readline
        readline.set_history_length(1000)
        if self.history_file:
            try:
                readline.read_history_file(self.history_file)
            except OSError:
                pass

    def _save_history(self) -> None:
        if self._readline is None or not self.history_file:
            return
        try:
            os.makedirs(os.path.dirname(self.history_file) or ".", exist_ok=True)
            self._readline.write_history_file(self.history_file)
        except OSError:
            pass
