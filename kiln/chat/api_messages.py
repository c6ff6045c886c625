"""Chat API messages (OpenAI's roles) to prompt ids, through the model's chat template.

The layout is kiln's one chat format (`kiln.chat.render`: each message its role token, its
text, `<|end|>`, then `<|assistant|>` for the reply, which stops at `<|end|>`), shared with
export and post-training; the server (kiln.serve) renders its chat requests here. A base
model's tokenizer has no chat tokens: `ServerChat.of` returns None and the server answers chat
requests with a 400 saying so. Message text that spells a control token is refused, in every
message; the error names the message as OpenAI's `param`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.chat.render import render
from kiln.chat.template import ChatTemplate, chat_template_of
from kiln.errors import KilnError
from kiln.tokenizer.tokenizer import Tokenizer

# OpenAI's "developer" role is its newer name for "system".
ROLE_NAMES = {"developer": "system"}


class ChatMessageError(KilnError):
    """A chat message the template refuses; `param` names it (messages[i].content)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ServerChat:
    """A tokenizer and its chat template, rendering API messages to prompt ids."""

    tokenizer: Tokenizer
    template: ChatTemplate

    @classmethod
    def of(cls, tokenizer: Tokenizer | None) -> ServerChat | None:
        """The chat of a tokenizer with the chat tokens, else None (a base model)."""
        template = chat_template_of(tokenizer) if tokenizer is not None else None
        return None if template is None else cls(tokenizer, template)  # type: ignore[arg-type]

    @property
    def end_id(self) -> int:
        """The id that ends a reply."""
        return self.template.end_id

    def render(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Prompt ids of (role, text) messages followed by the assistant's turn."""
        conversation = [{"role": ROLE_NAMES.get(r, r), "content": t} for r, t in messages]
        try:
            return render(
                conversation, self.tokenizer, add_generation_prompt=True, where="messages"
            ).ids
        except KilnError as exc:
            found = re.search(r"message (\d+)", str(exc))
            param = f"messages[{found.group(1)}].content" if found else "messages"
            raise ChatMessageError(str(exc), param) from None
