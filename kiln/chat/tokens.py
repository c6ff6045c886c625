"""The chat format's role and control tokens, and a tokenizer that holds them.

Each message is its role token, its text, then END; a reply is generated after ASSISTANT and
stops at END (DESIGN.md, "Chat format"). The tokens are special tokens: `kiln tokenizer train
--chat` reserves them, `kiln posttrain add-chat-tokens` appends them to a base tokenizer.
"""

from __future__ import annotations

from kiln.tokenizer.special import ASSISTANT, CHAT_TOKENS, END, SYSTEM, USER
from kiln.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ASSISTANT", "CHAT_TOKENS", "END", "ROLES", "ROLE_TOKENS", "SYSTEM", "USER", "with_chat_tokens"
]  # fmt: skip

ROLE_TOKENS: dict[str, str] = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
ROLES = tuple(ROLE_TOKENS)


def with_chat_tokens(tok: Tokenizer) -> tuple[Tokenizer, dict[str, int]]:
    """`tok` plus the chat tokens it lacks, appended after its largest id; (new tokenizer, added)."""
    missing = [t for t in CHAT_TOKENS if t not in tok.special_tokens]
    specials = dict(tok.special_tokens)
    added = {t: tok.n_vocab + k for k, t in enumerate(missing)}
    specials.update(added)
    grown = Tokenizer(tok.vocab, tok.merges, specials, tok.pattern, metadata=tok.metadata)
    return grown, added
