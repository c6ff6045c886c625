"""The special-token policy for text a user typed (prompts, sample prompts in a config).

Text that merely contains "<|endoftext|>" must not silently become the control token: it is
refused with one line naming where the text came from and how to opt in, unless the caller
was told to allow it (`kiln sample --allow-special`, `eval.allow_special = true`).
"""

from __future__ import annotations

from kiln.errors import KilnError
from kiln.tokenizer.pretokenize import special_regex
from kiln.tokenizer.tokenizer import Tokenizer


def check_user_text(tok: Tokenizer, text: str, where: str, opt_in: str | None) -> None:
    """Refuse `text` if it holds special-token text: `where` names it, `opt_in` says how to allow
    (None: nothing allows it, as in a chat message)."""
    pattern = special_regex(tuple(sorted(tok.special_tokens)))
    match = pattern.search(text) if pattern is not None else None
    if match is not None:
        how = (
            f"{opt_in} to encode it as that control token, or remove it" if opt_in else "remove it"
        )
        raise KilnError(
            f"{where} contains the special token {match.group()!r} (at character "
            f"{match.start()}); special-token text in user input is refused: {how}"
        )


def encode_user_text(
    tok: Tokenizer, text: str, allow_special: bool, where: str, opt_in: str | None
) -> list[int]:
    """Token ids of user text under the policy: special-token text only where allowed."""
    if allow_special:
        return list(tok.encode(text, allowed_special="all"))
    check_user_text(tok, text, where, opt_in)
    return list(tok.encode(text))
