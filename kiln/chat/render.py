"""The chat format: a conversation as token ids plus a loss mask.

A conversation is a list of messages `{"role": "system" | "user" | "assistant", "content": str}`.
Each message renders as its role token, its text, then `<|end|>`; with `add_generation_prompt`
an `<|assistant|>` token follows, after which a model writes its reply and stops at `<|end|>`.
`kiln.chat.template.JINJA_TEMPLATE` is the same layout for transformers.

Message text is encoded under the refusing special-token policy (`kiln.tokenizer.user_text`):
text that merely contains `<|assistant|>` (or any other special token) is an error, never the
control token, whatever the role. The loss mask covers what a model is trained to write: each
assistant message's text and its `<|end|>`, not its role token and nothing of the other roles.

This is the one renderer: export (train), the server (serve) and post-training all use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.chat.template import require_chat_template
from kiln.chat.tokens import ASSISTANT, END, ROLE_TOKENS, ROLES
from kiln.errors import KilnError
from kiln.tokenizer.tokenizer import Tokenizer
from kiln.tokenizer.user_text import encode_user_text

Message = Mapping[str, Any]


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation: token ids and, per id, 1 where the loss counts (else 0)."""

    ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.ids)


def check_conversation(conversation: Any, where: str = "conversation") -> list[Message]:
    """The messages of `conversation`, or a KilnError naming the first bad message and field."""
    if isinstance(conversation, Mapping) and "messages" in conversation:
        conversation = conversation["messages"]
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence):
        raise KilnError(
            f"{where}: expected a list of messages ({{'role': ..., 'content': ...}}), "
            f"got {type(conversation).__name__}"
        )
    if not conversation:
        raise KilnError(f"{where}: no messages")
    for i, message in enumerate(conversation):
        if not isinstance(message, Mapping):
            raise KilnError(
                f"{where}: message {i}: expected an object with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        role = message.get("role")
        if role not in ROLE_TOKENS:
            raise KilnError(f"{where}: message {i}: role {role!r} is not one of {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            raise KilnError(
                f"{where}: message {i} ({role}): content must be a string, "
                f"got {type(content).__name__}"
            )
    return list(conversation)


def render(
    conversation: Any,
    tokenizer: Tokenizer,
    add_generation_prompt: bool = False,
    where: str = "conversation",
) -> RenderedChat:
    """Token ids and loss mask of a conversation (see the module doc for the layout)."""
    template = require_chat_template(tokenizer, where)
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(check_conversation(conversation, where)):
        role = message["role"]
        text = encode_user_text(
            tokenizer, message["content"], False, f"{where}: message {i} ({role})", None
        )
        counts = 1 if role == "assistant" else 0
        ids += [template.role_ids[role], *text, template.end_id]
        mask += [0] + [counts] * (len(text) + 1)
    if add_generation_prompt:
        ids.append(template.assistant_id)
        mask.append(0)
    return RenderedChat(ids, mask)


def render_text(conversation: Any, add_generation_prompt: bool = False) -> str:
    """The conversation as text, as `JINJA_TEMPLATE` writes it (what HF then tokenizes)."""
    parts = [ROLE_TOKENS[m["role"]] + m["content"] + END for m in check_conversation(conversation)]
    return "".join(parts) + (ASSISTANT if add_generation_prompt else "")
