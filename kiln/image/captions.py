"""Captions as token ids for the text encoder: kiln's BPE, trained on the training captions."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.tokenizer import Tokenizer, special

EOT = special.EOT  # the one special token: caption text spelling it is refused


def train_caption_tokenizer(captions: Sequence[str], vocab_size: int, out: Path) -> Tokenizer:
    """A byte-level BPE of `vocab_size` trained on `captions`, saved to `out` (tokenizer.json)."""
    from kiln.tokenizer.train import train_bpe

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", suffix=".txt", dir=out.parent, delete=False
    ) as handle:
        handle.write("\n".join(captions) + "\n")
    try:
        tok = train_bpe(handle.name, vocab_size, special_tokens=[EOT], workers=1)
    finally:
        os.unlink(handle.name)
    tok.save(out)
    return tok


def encode_captions(
    tok: Tokenizer, captions: Sequence[str], max_tokens: int, start_id: int, pad_id: int,
    what: str = "caption",
) -> torch.Tensor:  # fmt: skip
    """(N, 1 + longest) int64 ids: the start token, the caption's tokens, then padding.

    A caption with special-token text or more than `max_tokens` tokens is a KilnError naming
    `what` (the flag or file it came from).
    """
    rows = []
    for text in captions:
        try:
            ids = tok.encode(text)
        except ValueError:
            raise KilnError(f"{what}: {text!r} contains control-token text ({EOT})") from None
        if len(ids) > max_tokens:
            raise KilnError(
                f"{what}: {text!r} is {len(ids)} tokens; the model takes at most {max_tokens}"
            )
        rows.append([start_id, *ids])
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out
