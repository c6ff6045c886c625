"""The Tokenizer: byte-level BPE encode/decode with an explicit special-token policy."""

from __future__ import annotations

import itertools
import os
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from kiln.errors import KilnError
from kiln.tokenizer.cuts import CutFinder
from kiln.tokenizer.native import NATIVE
from kiln.tokenizer.patterns import SplitPattern, resolve_pattern
from kiln.tokenizer.pretokenize import (
    iter_pretokens,
    special_regex,
    split_on_specials_with,
    to_utf8,
)
from kiln.tokenizer.special import EOT

if TYPE_CHECKING:
    from kiln.tokenizer.formats.common import TokenizerParts

Backend = Literal["auto", "native", "reference"]
AllowedSpecial = Literal["all"] | Collection[str]

# The name that stands for the byte tokenizer wherever a tokenizer file is asked for (the
# `tokenize.tokenizer` TOML field, `kiln data tokenize --tokenizer`): vocab 256 + specials, no BPE.
BYTES = "bytes"

# encode_iterable buffers about this much text before it looks for a safe place to cut.
_ITERABLE_BUFFER_CHARS = 1 << 16


class Tokenizer:
    """A byte-level BPE tokenizer: vocab (id -> bytes), ranked merges, special tokens, pattern."""

    def __init__(
        self,
        vocab: Mapping[int, bytes],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: Mapping[str, int] | Sequence[str] | None = None,
        pattern: str | SplitPattern = "gpt2",
        *,
        metadata: Mapping[str, Any] | None = None,
        backend: Backend = "auto",
    ) -> None:
        self.vocab: dict[int, bytes] = {int(i): bytes(b) for i, b in vocab.items()}
        self.merges: list[tuple[bytes, bytes]] = [(bytes(a), bytes(b)) for a, b in merges]
        self.pattern = resolve_pattern(pattern)
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.special_tokens = self._resolve_specials(special_tokens)
        self._check_and_index()
        self._native = self._make_native(backend)

    # ----------------------------------------------------------------------------- construction
    def _resolve_specials(
        self, special_tokens: Mapping[str, int] | Sequence[str] | None
    ) -> dict[str, int]:
        if special_tokens is None:
            return {}
        if isinstance(special_tokens, Mapping):
            resolved = {str(s): int(i) for s, i in special_tokens.items()}
            for s, i in resolved.items():
                if not s:
                    raise KilnError("special tokens must be non-empty strings, got ''")
                existing = self.vocab.get(i)
                if existing is None:
                    self.vocab[i] = s.encode("utf-8")
                elif existing != s.encode("utf-8"):
                    raise KilnError(
                        f"special token {s!r} has id {i}, which already names token {existing!r}"
                    )
            return resolved
        by_bytes = {b: i for i, b in self.vocab.items()}
        resolved = {}
        for s in special_tokens:
            if not isinstance(s, str) or not s:
                raise KilnError(f"special tokens must be non-empty strings, got {s!r}")
            i = by_bytes.get(s.encode("utf-8"))
            if i is None:
                i = max(self.vocab, default=-1) + 1
                self.vocab[i] = s.encode("utf-8")
            resolved[s] = i
        return resolved

    def _check_and_index(self) -> None:
        """Validate the vocab/merges/specials and build the lookup tables encoding needs."""
        special_ids = set(self.special_tokens.values())
        if len(special_ids) != len(self.special_tokens):
            raise KilnError(f"two special tokens share an id: {self.special_tokens}")
        self._id_of: dict[bytes, int] = {}
        for i, b in sorted(self.vocab.items()):
            if i < 0:
                raise KilnError(f"vocab id {i} is negative")
            if i in special_ids:
                continue
            if b in self._id_of:
                raise KilnError(f"vocab ids {self._id_of[b]} and {i} both hold the bytes {b!r}")
            self._id_of[b] = i
        missing = [v for v in range(256) if bytes([v]) not in self._id_of]
        if missing:
            raise KilnError(f"vocab lacks single-byte tokens for byte values {missing[:8]}...")
        self._byte_ids = [self._id_of[bytes([v])] for v in range(256)]
        self._ranks: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, (a, b) in enumerate(self.merges):
            ids = (self._id_of.get(a), self._id_of.get(b), self._id_of.get(a + b))
            if None in ids:
                raise KilnError(
                    f"merge {rank} ({a!r}, {b!r}): its parts and result must all be in the vocab"
                )
            key = (ids[0], ids[1])
            if key not in self._ranks:
                self._ranks[key] = (rank, ids[2])  # type: ignore[assignment]

    def _make_native(self, backend: Backend) -> Any:
        if backend == "reference" or (backend == "auto" and NATIVE is None):
            return None
        if NATIVE is None:
            raise KilnError("backend='native' requested but the native extension is not built")
        decoder = [b""] * (self.n_vocab)
        valid = [False] * (self.n_vocab)
        for i, b in self.vocab.items():
            decoder[i], valid[i] = b, True
        merges = [
            (a, b, new) for (a, b), (_, new) in sorted(self._ranks.items(), key=lambda kv: kv[1][0])
        ]
        name = self.pattern.name if self.pattern.is_builtin else ""
        return NATIVE.Encoder(self._byte_ids, merges, decoder, valid, name)

    # The file formats' modules never import this class (readers return TokenizerParts), so
    # these import them, not the other way round. They import inside the methods because the
    # formats package's __init__ (read_any and friends) builds on this module and Python runs
    # that __init__ before any of its modules.
    @classmethod
    def from_parts(cls, parts: TokenizerParts) -> Tokenizer:
        """Build from what a format reader returns; an inconsistency names the file it came from."""
        try:
            return cls(
                parts.vocab,
                parts.merges,
                parts.special_tokens,
                parts.pattern,
                metadata=parts.metadata,
            )
        except KilnError as exc:
            raise KilnError(f"{parts.source}: {exc}") from None

    @classmethod
    def from_gpt2(
        cls,
        vocab_json_path: str | os.PathLike[str],
        merges_txt_path: str | os.PathLike[str],
        special_tokens: Sequence[str] = (EOT,),
    ) -> Tokenizer:
        """Load GPT-2's `vocab.json` (encoder.json) and `merges.txt` (vocab.bpe)."""
        from kiln.tokenizer.formats.gpt2 import parse_gpt2

        return cls.from_parts(parse_gpt2(vocab_json_path, merges_txt_path, special_tokens))

    @classmethod
    def raw_bytes(cls, special_tokens: Sequence[str] = (EOT,)) -> Tokenizer:
        """The byte tokenizer: id b is byte b (0..255), the specials after them, no merges.

        A model over raw UTF-8 bytes; with no merges the pattern only cuts text where nothing
        would be merged anyway, so every byte becomes its own token.
        """
        vocab = {b: bytes([b]) for b in range(256)}
        return cls(vocab, [], list(special_tokens), metadata={"kind": BYTES})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a kiln `tokenizer.json`, validating it."""
        from kiln.tokenizer.formats.kiln_json import parse_kiln

        return cls.from_parts(parse_kiln(path))

    def save(self, path: str | os.PathLike[str], *, force: bool = True) -> None:
        """Write this tokenizer as a kiln `tokenizer.json` (atomically)."""
        from kiln.tokenizer.formats.kiln_json import write_kiln

        write_kiln(self, path, force=force)

    # ------------------------------------------------------------------------------ properties
    @property
    def n_vocab(self) -> int:
        """One more than the largest id (the size an embedding table needs)."""
        return max(self.vocab) + 1

    @property
    def backend(self) -> str:
        """`native` when the compiled extension does the work, else `reference`."""
        return "reference" if self._native is None else "native"

    def __repr__(self) -> str:
        return (
            f"Tokenizer(n_vocab={self.n_vocab}, merges={len(self.merges)}, "
            f"pattern={self.pattern.name!r}, special_tokens={list(self.special_tokens)}, "
            f"backend={self.backend!r})"
        )

    # -------------------------------------------------------------------------------- encoding
    def _bpe(self, piece: bytes) -> list[int]:
        """Reference BPE of one pre-token: merge the lowest-ranked adjacent pair, leftmost first."""
        ids = [self._byte_ids[b] for b in piece]
        ranks = self._ranks
        while len(ids) > 1:
            best_rank, best_pos, best_id = None, -1, -1
            for pos, pair in enumerate(itertools.pairwise(ids)):
                found = ranks.get(pair)
                if found is not None and (best_rank is None or found[0] < best_rank):
                    best_rank, best_pos, best_id = found[0], pos, found[1]
            if best_rank is None:
                break
            ids[best_pos : best_pos + 2] = [best_id]
        return ids

    def _encode_ordinary_bytes(self, data: bytes) -> list[int]:
        if self._native is not None:
            if self.pattern.is_builtin:
                return self._native.encode(data)
            pieces = [p.encode("utf-8") for p in iter_pretokens(data.decode("utf-8"), self.pattern)]
            return self._native.encode_pieces(pieces)
        out: list[int] = []
        for piece in iter_pretokens(data.decode("utf-8"), self.pattern):
            out.extend(self._bpe(piece.encode("utf-8")))
        return out

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode `text`, treating any special-token text in it as ordinary text."""
        return self._encode_ordinary_bytes(to_utf8(text))

    def _allowed(self, allowed_special: AllowedSpecial) -> set[str]:
        if allowed_special == "all":
            return set(self.special_tokens)
        if isinstance(allowed_special, str):
            raise ValueError(
                f"allowed_special must be 'all' or a set of special tokens, "
                f"got the string {allowed_special!r} (did you mean {{{allowed_special!r}}}?)"
            )
        allowed = set(allowed_special)
        unknown = allowed - set(self.special_tokens)
        if unknown:
            raise ValueError(
                f"allowed_special names unknown special tokens {sorted(unknown)}; "
                f"this tokenizer has {sorted(self.special_tokens)}"
            )
        return allowed

    def _check_disallowed(self, text: str, allowed: set[str]) -> None:
        disallowed = tuple(sorted(set(self.special_tokens) - allowed))
        if not disallowed:
            return
        pattern = special_regex(tuple(sorted(self.special_tokens)))
        assert pattern is not None
        for match in pattern.finditer(text):
            if match.group() in disallowed:
                raise ValueError(
                    f"text contains the special token {match.group()!r} at character "
                    f"{match.start()}; pass allowed_special={{{match.group()!r}}} (or 'all') to "
                    "encode it as a special token, or use encode_ordinary() to encode it as text"
                )

    def encode(self, text: str, allowed_special: AllowedSpecial = frozenset()) -> list[int]:
        """Encode `text`; special-token text raises ValueError unless listed in `allowed_special`."""
        allowed = self._allowed(allowed_special)
        if self.special_tokens:
            self._check_disallowed(text, allowed)
        if not allowed:
            return self.encode_ordinary(text)
        pattern = special_regex(tuple(sorted(allowed)))
        assert pattern is not None
        out: list[int] = []
        for segment, is_special in split_on_specials_with(pattern, text):
            if is_special:
                out.append(self.special_tokens[segment])
            else:
                out.extend(self.encode_ordinary(segment))
        return out

    def encode_batch(
        self,
        texts: Sequence[str],
        allowed_special: AllowedSpecial = frozenset(),
        workers: int | None = None,
    ) -> list[list[int]]:
        """Encode many texts; the native path spreads them over `workers` threads (default: all)."""
        allowed = self._allowed(allowed_special)
        if self._native is None or not self.pattern.is_builtin:
            return [self.encode(t, allowed) for t in texts]
        if self.special_tokens:
            for t in texts:
                self._check_disallowed(t, allowed)
        threads = max(1, workers if workers is not None else (os.cpu_count() or 1))
        if not allowed:
            return self._native.encode_batch([to_utf8(t) for t in texts], threads)
        # Cut every text at its allowed special tokens, encode all ordinary pieces in one
        # threaded batch, then stitch each text back together with the special ids.
        pattern = special_regex(tuple(sorted(allowed)))
        assert pattern is not None
        layouts: list[list[int | None]] = []
        pieces: list[bytes] = []
        for text in texts:
            layout: list[int | None] = []
            for segment, is_special in split_on_specials_with(pattern, text):
                if is_special:
                    layout.append(self.special_tokens[segment])
                else:
                    layout.append(None)
                    pieces.append(to_utf8(segment))
            layouts.append(layout)
        encoded = iter(self._native.encode_batch(pieces, threads))
        out = []
        for layout in layouts:
            ids: list[int] = []
            for item in layout:
                if item is None:
                    ids.extend(next(encoded))
                else:
                    ids.append(item)
            out.append(ids)
        return out

    def encode_iterable(
        self, iterable: Iterable[str], allowed_special: AllowedSpecial = frozenset()
    ) -> Iterator[int]:
        """Lazily encode a stream of strings (e.g. a file's lines) with bounded memory.

        Text is buffered until it can be cut where the cut cannot change the encoding (see
        `cuts.py`), so the ids equal `encode` of the whole stream. Memory is bounded by the
        longest stretch without such a place (for custom patterns: between special tokens).
        """
        allowed = self._allowed(allowed_special)
        cuts: CutFinder[str] = CutFinder(list(self.special_tokens), self.pattern.is_builtin, False)
        pending: list[str] = []
        pending_size = 0
        buffer = ""
        threshold = _ITERABLE_BUFFER_CHARS
        for piece in iterable:
            pending.append(piece)
            pending_size += len(piece)
            if len(buffer) + pending_size < threshold:
                continue
            buffer += "".join(pending)
            pending.clear()
            pending_size = 0
            cut = cuts.last_cut(buffer)
            if cut > 0:
                yield from self.encode(buffer[:cut], allowed)
                buffer = buffer[cut:]
                cuts.reset()
                threshold = _ITERABLE_BUFFER_CHARS
            else:
                # Nothing to cut yet: wait for the buffer to double, so the copying stays linear.
                threshold = 2 * len(buffer)
        buffer += "".join(pending)
        if buffer:
            yield from self.encode(buffer, allowed)

    # -------------------------------------------------------------------------------- decoding
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes the ids stand for; an unknown id raises ValueError naming it."""
        if self._native is not None:
            return self._native.decode_bytes(ids if isinstance(ids, list) else list(ids))
        out = []
        for i in ids:
            b = self.vocab.get(i)
            if b is None:
                raise ValueError(f"token id {i} is not in the vocabulary (size {self.n_vocab})")
            out.append(b)
        return b"".join(out)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode to text; byte sequences that are not valid UTF-8 become U+FFFD."""
        if self._native is not None:
            return self._native.decode(ids if isinstance(ids, list) else list(ids))
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> bytes:
        """The bytes of one token id."""
        return self.vocab[i]
