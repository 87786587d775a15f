"""A stub on a model's forward that makes it write a scripted token sequence, so a test knows what a tiny random model
"thinks" and answers (tests/test_reasoning.py, tests/test_harmony_tools.py)."""
from __future__ import annotations


class Script:
    """Stub on the model's forward: the i-th generated token of the request gets a +1000 logit for script[i] (a
    grammar mask still has the last word, so a forced closing tag or a JSON constraint wins over the script).
    template: a chat template source to chat with instead of the model's own (None: the model's)."""

    def __init__(self, llm, template: str | None = None):
        from edgellm.chat_template import ChatTemplate

        self.llm, self.ids, self.prompt_len = llm, [], 0
        if template is not None:
            llm.__dict__["chat_template"] = ChatTemplate(template, name="test-think")  # the template the tests write
        self._forward = llm.model.forward
        llm.model.forward = self.forward

    def set(self, messages, script_text: str, *, after: int = 0, special: bool = False, **turn):
        """Script the output from its token `after` on (earlier ones: what the matcher forces) for the turn of
        these messages (turn: ChatTurn keywords such as tools); special: control-token texts are those tokens."""
        from edgellm.chat_turn import ChatTurn

        self.prompt_len = len(self.llm.prompt_ids(ChatTurn(self.llm, messages, **turn).prompt)) + after
        self.ids = self.llm.tokenize(script_text, special=special)

    def forward(self, batch, kv):
        logits = self._forward(batch, kv)  # (rows, V)
        for r, row in enumerate(batch.logit_rows):
            i = int(batch.positions[row]) + 1 - self.prompt_len  # index of the token being chosen
            if 0 <= i < len(self.ids):
                logits[r, self.ids[i]] += 1000.0
        return logits

    def close(self):
        self.llm.model.forward = self._forward
        self.llm.__dict__.pop("chat_template", None)
