"""Chat messages to prompt ids, when the model's tokenizer has kiln's chat control tokens.

A tokenizer that holds <|system|>, <|user|>, <|assistant|> and <|end|> as special tokens (what
post-training adds) renders a conversation as `<|role|>text<|end|>` per message, then
`<|assistant|>` for the reply, which ends at <|end|>. Every message's text is encoded under the
refusing policy, so text that spells a control token is an error naming the message. A base
model has no such tokens: `ChatTemplate.of` returns None and the server answers chat with a 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.tokenizer.tokenizer import Tokenizer
from kiln.tokenizer.user_text import encode_user_text

SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
CHAT_TOKENS = (SYSTEM, USER, ASSISTANT, END)
# OpenAI's "developer" role is its newer name for "system".
ROLE_TOKENS = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "assistant": ASSISTANT}
NO_OPT_IN = "send token ids to /v1/completions"


@dataclass(frozen=True)
class ChatTemplate:
    """The chat control tokens' ids in one tokenizer, and how a conversation renders with them."""

    tokenizer: Tokenizer
    role_ids: dict[str, int]
    end_id: int

    @classmethod
    def of(cls, tokenizer: Tokenizer | None) -> ChatTemplate | None:
        """The template of a tokenizer holding all four chat tokens, else None (a base model)."""
        if tokenizer is None:
            return None
        specials = tokenizer.special_tokens
        if not all(t in specials for t in CHAT_TOKENS):
            return None
        roles = {role: specials[token] for role, token in ROLE_TOKENS.items()}
        return cls(tokenizer, roles, specials[END])

    def render(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Prompt ids of (role, text) messages followed by the assistant's turn.

        Text that spells a special token raises KilnError naming messages[i].content.
        """
        ids: list[int] = []
        for i, (role, text) in enumerate(messages):
            where = f"messages[{i}].content"
            ids.append(self.role_ids[role])
            ids += encode_user_text(self.tokenizer, text, False, where, NO_OPT_IN)
            ids.append(self.end_id)
        ids.append(self.role_ids["assistant"])
        return ids
