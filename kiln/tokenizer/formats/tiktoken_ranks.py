"""tiktoken rank files (`base64(token) rank` per line): export, and import with merges rebuilt.

A rank file holds no merge list: tiktoken merges, inside a pre-token, the adjacent pair whose
concatenation has the lowest rank. Importing therefore reconstructs each token's merge as the two
parts that BPE over the lower-ranked tokens leaves, which gives the same encodings.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kiln.errors import KilnError
from kiln.io import atomic_write, check_can_write
from kiln.tokenizer.formats.common import (
    PathLike,
    TokenizerParts,
    check_specials,
    check_vocab,
    checked_parts,
    read_text,
    regular_ids,
    regular_vocab,
)

if TYPE_CHECKING:
    from kiln.tokenizer.tokenizer import Tokenizer

TIKTOKEN_LINE = re.compile(r"^[A-Za-z0-9+/=]+ \d+$")


def _check_tiktoken_compatible(tok: Tokenizer) -> None:
    """tiktoken derives merge order from token ids: each merge must create a higher id."""
    id_of = regular_ids(tok)
    produced: set[bytes] = set()
    last = -1
    for rank, (a, b) in enumerate(tok.merges):
        new = id_of[a + b]
        if a + b in produced:
            continue
        if new <= max(last, id_of[a], id_of[b]):
            raise KilnError(
                f"cannot export as tiktoken ranks: merge {rank} creates id {new}, not above the "
                "ids of its parts and of earlier merges (tiktoken ranks are ids and imply the order)"
            )
        produced.add(a + b)
        last = new
    unreachable = [b for b in id_of if len(b) > 1 and b not in produced]
    if unreachable:
        raise KilnError(
            f"cannot export as tiktoken ranks: {len(unreachable)} multi-byte token(s) such as "
            f"{unreachable[0]!r} are not produced by any merge"
        )


def write_tiktoken(tok: Tokenizer, path: PathLike, force: bool = False) -> None:
    """Export `tok` as a tiktoken rank file: `base64(token bytes) rank` per line, rank = id."""
    check_can_write(path, force)
    _check_tiktoken_compatible(tok)
    lines = [f"{base64.b64encode(b).decode('ascii')} {i}\n" for i, b in regular_vocab(tok).items()]
    with atomic_write(path, "w") as handle:
        handle.writelines(lines)


def _read_tiktoken_ranks(path: PathLike) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    for line_no, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        if not TIKTOKEN_LINE.match(line):
            raise KilnError(
                f"{os.fspath(path)}:{line_no}: expected 'BASE64 RANK', got {line!r:.60}"
            )
        encoded, rank_text = line.split(" ")
        try:
            token = base64.b64decode(encoded, validate=True)
        except binascii.Error:
            raise KilnError(f"{os.fspath(path)}:{line_no}: {encoded!r:.40} is not base64") from None
        rank = int(rank_text)
        if token in ranks or rank in seen_ranks or not token:
            raise KilnError(
                f"{os.fspath(path)}:{line_no}: token {token!r} or rank {rank} appears twice "
                "(or the token is empty)"
            )
        ranks[token] = rank
        seen_ranks.add(rank)
    return ranks


def _rank_bpe(token: bytes, ranks: Mapping[bytes, int], below: int) -> list[bytes]:
    """tiktoken's BPE of `token` using only tokens ranked below `below`: merge the lowest first."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_at = below, -1
        for k in range(len(parts) - 1):
            rank = ranks.get(parts[k] + parts[k + 1], below)
            if rank < best_rank:
                best_rank, best_at = rank, k
        if best_at < 0:
            break
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts


def merges_from_ranks(path: PathLike, ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list tiktoken's ranks imply: each multi-byte token splits into two lower ones."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = _rank_bpe(token, ranks, rank)
        if len(parts) != 2:
            raise KilnError(
                f"{os.fspath(path)}: token {token!r} (rank {rank}) is not the merge of two "
                f"lower-ranked tokens (BPE over lower ranks leaves {len(parts)} parts)"
            )
        merges.append((parts[0], parts[1]))
    return merges


def parse_tiktoken(
    path: PathLike, pattern: str = "gpt2", special_tokens: Mapping[str, int] | None = None
) -> TokenizerParts:
    """Read a tiktoken rank file; the pattern and special tokens are not in it, so pass them."""
    ranks = _read_tiktoken_ranks(path)
    vocab = {rank: token for token, rank in ranks.items()}
    check_vocab(path, vocab)
    specials = dict(special_tokens or {})
    check_specials(path, specials, vocab)
    return checked_parts(path, vocab, merges_from_ranks(path, ranks), specials, pattern)
