"""A tokenizer's chat template: the ids of the chat tokens, and the layout as Jinja for export.

`kiln export` writes `JINJA_TEMPLATE` as `chat_template` in `tokenizer_config.json`; there are no
separators besides the role and control tokens, so `transformers`' `apply_chat_template` (text,
then tokenized) gives exactly the ids of `kiln.chat.render`: its tokenizer, like kiln's, cuts
text at special tokens first and encodes the pieces between them on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.chat.tokens import ASSISTANT, CHAT_TOKENS, END, ROLE_TOKENS
from kiln.errors import KilnError
from kiln.tokenizer.tokenizer import Tokenizer


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
