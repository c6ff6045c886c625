"""The chat format: a conversation as token ids plus a loss mask, and the same layout in Jinja.

A conversation is a list of messages `{"role": "system" | "user" | "assistant", "content": str}`.
Each message renders as its role token, its text, then `<|end|>`; with `add_generation_prompt`
an `<|assistant|>` token follows, after which a model writes its reply and stops at `<|end|>`.
There are no separators besides these tokens, so `transformers`' `apply_chat_template` with
`JINJA_TEMPLATE` (text, then tokenized) gives exactly these ids: its tokenizer, like kiln's, cuts
text at special tokens first and encodes the pieces between them on their own.

Message text is encoded under the refusing special-token policy (`kiln.tokenizer.user_text`):
text that merely contains `<|assistant|>` (or any other special token) is an error, never the
control token, whatever the role. The loss mask covers what a model is trained to write: each
assistant message's text and its `<|end|>`, not its role token and nothing of the other roles.

This lives in the tokenizer layer so that export (train), the server (serve) and post-training
all use the one renderer; `kiln.posttrain.chat_format` is its post-training face.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError
from kiln.tokenizer.special import ASSISTANT, CHAT_TOKENS, END, SYSTEM, USER
from kiln.tokenizer.tokenizer import Tokenizer
from kiln.tokenizer.user_text import encode_user_text

ROLE_TOKENS: dict[str, str] = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
ROLES = tuple(ROLE_TOKENS)


def _jinja_template() -> str:
    """The same layout for transformers (tokenizer_config.json's chat_template).

    Role tokens are written out per role (not built from the role's name), so an unknown role
    raises there as it does here.
    """
    branches = "".join(
        ("{% if" if k == 0 else "{% elif") + f" message['role'] == '{role}' %}}{{{{ '{token}' }}}}"
        for k, (role, token) in enumerate(ROLE_TOKENS.items())
    )
    return (
        "{% for message in messages %}" + branches
        + "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
        + "{{ message['content'] }}" + f"{{{{ '{END}' }}}}" + "{% endfor %}"
        + "{% if add_generation_prompt %}" + f"{{{{ '{ASSISTANT}' }}}}" + "{% endif %}"
    )  # fmt: skip


JINJA_TEMPLATE = _jinja_template()

Message = Mapping[str, Any]


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation: token ids and, per id, 1 where the loss counts (else 0)."""

    ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat tokens: the ids of each role, of `<|end|>`, and the Jinja template."""

    role_ids: dict[str, int]
    end_id: int
    jinja: str = JINJA_TEMPLATE

    @property
    def assistant_id(self) -> int:
        """The id that starts a reply (the generation prompt)."""
        return self.role_ids["assistant"]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a reply."""
        return (self.end_id,)


def chat_template_of(tok: Tokenizer) -> ChatTemplate | None:
    """The tokenizer's chat template; None for a base tokenizer without the chat tokens.

    A tokenizer with only some of them is an error (it cannot render every role).
    """
    have = [t for t in CHAT_TOKENS if t in tok.special_tokens]
    if not have:
        return None
    if len(have) != len(CHAT_TOKENS):
        missing = [t for t in CHAT_TOKENS if t not in tok.special_tokens]
        raise KilnError(
            f"the tokenizer has the chat tokens {have} but not {missing}; add them all "
            "(kiln posttrain add-chat-tokens) or none"
        )
    ids = tok.special_tokens
    return ChatTemplate({role: ids[token] for role, token in ROLE_TOKENS.items()}, ids[END])


def require_chat_template(tok: Tokenizer, where: str) -> ChatTemplate:
    """The tokenizer's chat template, or one error line saying how to get one."""
    template = chat_template_of(tok)
    if template is None:
        raise KilnError(
            f"{where}: the tokenizer has no chat tokens ({', '.join(CHAT_TOKENS)}); add them with "
            "`kiln posttrain add-chat-tokens MODEL OUT` (or train one with `kiln tokenizer train "
            "--chat`)"
        )
    return template


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
