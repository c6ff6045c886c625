"""Language-modelling metrics: loss and perplexity on a dataset's val split, bits-per-byte on text.

Both score long token streams in sliding windows (`scoring.rolling_windows`): every token is
predicted exactly once, with as much left context as the block size and stride allow.

Bits-per-byte does not depend on the tokenizer: total nats / (ln 2 · UTF-8 bytes of the text).
Each document is preceded by the end-of-text token, so its first token is scored too; a
tokenizer without one leaves each document's first token (and its bytes) unscored.

`stream_bits_per_byte` is the speedrun's metric (docs/speedrun.md): a text file of documents
separated by end-of-text lines, read as training reads it (one stream, each document followed by
the end-of-text token), every byte of the file counted.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.eval.scoring import Scorer, TextEncoder
from kiln.io import iter_jsonl_texts, open_binary, strip_compression


@dataclass(frozen=True)
class LossResult:
    """Summed negative log-likelihood (nats) over scored tokens (and the bytes they cover)."""

    source: str
    nats: float
    n_tokens: int
    n_bytes: int | None  # None for token-only data (a shard dataset)
    n_documents: int
    stride: int
    seconds: float

    @property
    def loss(self) -> float:
        """Mean cross-entropy per token, in nats."""
        return self.nats / self.n_tokens

    @property
    def perplexity(self) -> float:
        """exp(loss)."""
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float | None:
        """Total nats / (ln 2 · bytes): comparable across tokenizers."""
        return None if not self.n_bytes else self.nats / (math.log(2) * self.n_bytes)


def val_loss(
    scorer: Scorer,
    dataset_dir: str | os.PathLike[str],
    split: str = "val",
    max_tokens: int | None = None,
    stride: int | None = None,
) -> LossResult:
    """Loss and perplexity on a token-shard dataset's split, read as one stream of documents
    (each ending with end-of-text, as training sees them); the first `max_tokens` when given."""
    from kiln.data.shard_reader import Dataset

    started = time.perf_counter()
    dataset = Dataset.open(dataset_dir)
    if dataset.vocab_size > scorer.model.cfg.vocab_size:
        raise KilnError(
            f"{dataset_dir}: encoded with a {dataset.vocab_size}-token vocabulary, larger than "
            f"the model's {scorer.model.cfg.vocab_size}"
        )
    data = dataset.split(split)
    n = data.n_tokens if max_tokens is None else min(max_tokens, data.n_tokens)
    if n < 2:
        raise KilnError(f"{dataset_dir}: split {split!r} has {data.n_tokens} tokens, need 2+")
    stride = stride or scorer.block_size
    tokens = data.read(0, n)
    data.check_ids(tokens, 0, dataset.vocab_size)
    (scored,) = scorer.score_documents([tokens], stride, desc=f"{split} loss")
    return LossResult(
        source=f"{dataset_dir}:{split}", nats=-scored.logprob, n_tokens=scored.n_tokens,
        n_bytes=None, n_documents=data.n_documents, stride=stride,
        seconds=time.perf_counter() - started,
    )  # fmt: skip


def read_documents(path: str | os.PathLike[str]) -> list[str]:
    """The documents of a text file: each `text` of a .jsonl, or the whole file otherwise
    (.gz/.zst/.bz2 read transparently)."""
    if strip_compression(path).endswith(".jsonl"):
        docs = list(iter_jsonl_texts(path))
    else:
        with open_binary(path) as handle:
            data = handle.read()
        try:
            docs = [data.decode("utf-8")]
        except UnicodeDecodeError as exc:
            raise KilnError(f"{path}: invalid UTF-8 at byte {exc.start}") from None
    docs = [d for d in docs if d]
    if not docs:
        raise KilnError(f"{path}: no text to score")
    return docs


def bits_per_byte(
    scorer: Scorer,
    tok: TextEncoder,
    path: str | os.PathLike[str],
    prefix_id: int | None,
    stride: int | None = None,
) -> LossResult:
    """Bits-per-byte (and per-token loss) of the documents of a text file."""
    started = time.perf_counter()
    texts = read_documents(path)
    prefix = [] if prefix_id is None else [prefix_id]
    documents = [prefix + tok.encode_ordinary(text) for text in texts]
    n_bytes = sum(len(text.encode("utf-8")) for text in texts)
    if prefix_id is None:  # each document's first token has no context: its bytes don't count
        n_bytes -= sum(len(tok.decode_bytes(doc[:1])) for doc in documents)
    stride = stride or scorer.block_size
    scored = scorer.score_documents(documents, stride, desc=f"bpb {Path(path).name}")
    if not any(s.n_tokens for s in scored):
        raise KilnError(f"{path}: too short to score (one token, no end-of-text to precede it)")
    return LossResult(
        source=os.fspath(path), nats=-sum(s.logprob for s in scored),
        n_tokens=sum(s.n_tokens for s in scored), n_bytes=n_bytes, n_documents=len(texts),
        stride=stride, seconds=time.perf_counter() - started,
    )  # fmt: skip


@dataclass(frozen=True)
class TokenStream:
    """A text file read as the speedrun scores it: one stream of ids, and the file's bytes."""

    ids: list[int]  # [eot] + (doc_1 + [eot]) + (doc_2 + [eot]) + ...
    n_bytes: int  # every byte of the (decompressed) file
    n_documents: int


def encode_stream(tok: TextEncoder, path: str | os.PathLike[str], eot_id: int) -> TokenStream:
    """The stream `stream_bits_per_byte` scores: each document as training's shards hold it
    (kiln.data.documents: split on separator lines, stripped), each followed by end-of-text, after
    a leading end-of-text. Count-based models (kiln/eval/baselines) score the same stream."""
    from kiln.data.documents import iter_documents
    from kiln.tokenizer.special import EOT

    with open_binary(path) as handle:
        n_bytes = len(handle.read())
    ids, n_docs = [eot_id], 0
    for doc in iter_documents(os.fspath(path), EOT):
        ids += tok.encode_ordinary(doc)
        ids.append(eot_id)
        n_docs += 1
    if n_docs == 0:
        raise KilnError(f"{path}: no text to score")
    return TokenStream(ids, n_bytes, n_docs)


def stream_bits_per_byte(
    scorer: Scorer,
    tok: TextEncoder,
    path: str | os.PathLike[str],
    eot_id: int,
    stride: int | None = None,
) -> LossResult:
    """Bits-per-byte of a file of end-of-text-separated documents, scored as one token stream.

    The stream is `encode_stream`'s. Every token after the leading end-of-text is scored once,
    in windows of at most the block size (disjoint with the default stride). The bytes are every
    byte of the (decompressed) file: those of the separator lines and the whitespace around them
    count toward the end-of-text token that stands for them.
    """
    started = time.perf_counter()
    stream = encode_stream(tok, path, eot_id)
    stride = stride or scorer.block_size
    (scored,) = scorer.score_documents([stream.ids], stride, desc=f"bpb {Path(path).name}")
    return LossResult(
        source=os.fspath(path), nats=-scored.logprob, n_tokens=scored.n_tokens,
        n_bytes=stream.n_bytes, n_documents=stream.n_documents, stride=stride,
        seconds=time.perf_counter() - started,
    )  # fmt: skip
