"""`tokenize_to_shards`: documents from input files -> encoded in worker processes -> a dataset dir.

The dataset is built in a temporary directory beside the output and renamed into place, so the
output path only ever holds a complete dataset; an existing dataset is replaced (with `force`)
by a rename, never edited.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kiln import __version__
from kiln.data.documents import SourceCounts, iter_documents
from kiln.data.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    Manifest,
    SourceEntry,
    TokenizerEntry,
    creation_time,
    is_shard_dataset,
)
from kiln.data.procs import interrupts_deferred, stop_pool, worker_init
from kiln.data.shard_format import dtype_for_vocab, dtype_name
from kiln.data.shard_writer import ShardWriter
from kiln.errors import KilnError, not_found
from kiln.fault_points import kill_point
from kiln.folders import abandoned_by
from kiln.io import sha256_file
from kiln.tokenizer import Tokenizer
from kiln.tokenizer.special import EOT
from kiln.tokenizer.tokenizer import BYTES

DEFAULT_EOT = EOT
BYTE_TOKENIZER_FILE = "tokenizer.json"  # where a `bytes` dataset keeps its tokenizer
SPLITS = ("train", "val")


@dataclass(frozen=True)
class TokenizeConfig:
    """Everything that determines a token-shard dataset (saved in its manifest)."""

    tokenizer: str
    inputs: tuple[str, ...]
    out: str
    val_docs: int | None = None  # exactly this many val documents; exclusive with val_fraction
    val_fraction: float | None = None  # else round(fraction * documents); default 0.01
    seed: int = 0
    shard_tokens: int = 100_000_000
    text_field: str = "text"
    eot_token: str = DEFAULT_EOT
    workers: int | None = None  # encoding processes; default: all cores
    batch_chars: int = 1 << 20  # text handed to a worker at a time
    parallel_min_bytes: int = 4 << 20  # smaller inputs are encoded in this process
    force: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.inputs:
            raise KilnError("no input files given")
        if self.val_docs is not None and self.val_fraction is not None:
            raise KilnError("give either val_docs or val_fraction, not both")
        if self.val_docs is not None and self.val_docs < 0:
            raise KilnError(f"val_docs must be >= 0, got {self.val_docs}")
        if self.val_fraction is not None and not 0.0 <= self.val_fraction < 1.0:
            raise KilnError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.shard_tokens < 1:
            raise KilnError(f"shard_tokens must be >= 1, got {self.shard_tokens}")
        if self.workers is not None and self.workers < 1:
            raise KilnError(f"workers must be >= 1, got {self.workers}")

    def n_val(self, total: int) -> int:
        """How many of `total` documents go to the val split (at least one train doc remains)."""
        if self.val_docs is not None:
            if self.val_docs >= total and self.val_docs > 0:
                raise KilnError(
                    f"val_docs = {self.val_docs} leaves no training documents: the inputs hold "
                    f"{total} documents"
                )
            return self.val_docs
        fraction = 0.01 if self.val_fraction is None else self.val_fraction
        if fraction == 0.0 or total < 2:
            return 0
        return min(total - 1, max(1, round(fraction * total)))


@dataclass
class _SourceTally:
    counts: SourceCounts = field(default_factory=SourceCounts)
    documents: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))


@functools.lru_cache(maxsize=2)
def _worker_tokenizer(path: str) -> Tokenizer:
    # Loaded once per worker process and reused for every batch it is sent.
    from kiln.tokenizer.formats import read_any

    return read_any(path)


def encode_documents(
    tok: Tokenizer, texts: list[str], eot_id: int, dtype: np.dtype, threads: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Encode texts as ordinary text, each followed by end-of-text: (flat tokens, lengths)."""
    try:
        encoded = tok.encode_batch(texts, workers=threads)
    except ValueError:
        # A document contains special-token text: shard data treats it as ordinary text.
        encoded = [tok.encode_ordinary(t) for t in texts]
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    flat = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    for ids, end, n in zip(encoded, ends, lengths, strict=True):
        flat[end - n : end - 1] = ids
        flat[end - 1] = eot_id
    return flat, lengths


def _encode_in_worker(
    tokenizer_path: str, texts: list[str], eot_id: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    return encode_documents(_worker_tokenizer(tokenizer_path), texts, eot_id, dtype)


@dataclass
class _Batch:
    texts: list[str] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    is_val: list[bool] = field(default_factory=list)
    chars: int = 0


def _iter_batches(
    config: TokenizeConfig, val_index: np.ndarray, tallies: list[_SourceTally]
) -> Iterator[_Batch]:
    """Documents in input order, grouped by size, each marked with its source and split."""
    batch, doc_index, next_val = _Batch(), 0, 0
    for source, path in enumerate(config.inputs):
        for text in iter_documents(
            path, config.eot_token, config.text_field, tallies[source].counts
        ):
            is_val = next_val < len(val_index) and val_index[next_val] == doc_index
            next_val += int(is_val)
            doc_index += 1
            batch.texts.append(text)
            batch.sources.append(source)
            batch.is_val.append(bool(is_val))
            batch.chars += len(text)
            if batch.chars >= config.batch_chars:
                yield batch
                batch = _Batch()
    if batch.texts:
        yield batch


def _count_documents(config: TokenizeConfig) -> int:
    """First pass: the number of documents, needed to pick exactly N val documents."""
    total = 0
    for path in config.inputs:
        for _ in iter_documents(path, config.eot_token, config.text_field):
            total += 1
    return total


def _load_tokenizer(config: TokenizeConfig) -> tuple[Tokenizer, TokenizerEntry]:
    return load_tokenizer_entry(config.tokenizer, config.eot_token)


def load_tokenizer_entry(path_text: str, eot_token: str) -> tuple[Tokenizer, TokenizerEntry]:
    """Load a tokenizer file (kiln, HF or GPT-2 vocab.json) and its manifest entry.

    `bytes` (BYTES) is the byte tokenizer; its entry's path and sha256 are those of the copy
    `tokenize_to_shards` writes into the dataset (`with_byte_tokenizer`).
    """
    from kiln.tokenizer.formats import read_any

    if path_text == BYTES:
        tok = Tokenizer.raw_bytes([eot_token])
        entry = TokenizerEntry(BYTES, "", tok.n_vocab, eot_token, tok.special_tokens[eot_token])
        return tok, entry
    path = Path(path_text)
    if not path.is_file():
        raise not_found(path, "tokenizer file")
    tok = read_any(path)
    eot_id = tok.special_tokens.get(eot_token)
    if eot_id is None:
        raise KilnError(
            f"{path}: the tokenizer has no special token {eot_token!r} to end documents "
            f"with (it has {sorted(tok.special_tokens)}); pass --eot-token"
        )
    entry = TokenizerEntry(
        path=os.path.abspath(path),
        sha256=sha256_file(path),
        vocab_size=tok.n_vocab,
        eot_token=eot_token,
        eot_id=eot_id,
    )
    return tok, entry


def with_byte_tokenizer(
    tok: Tokenizer, entry: TokenizerEntry, tmp: Path, out: Path
) -> TokenizerEntry:
    """Save the byte tokenizer into the dataset being built; the entry names its final place."""
    if entry.path != BYTES:
        return entry
    tok.save(tmp / BYTE_TOKENIZER_FILE)
    return replace(
        entry,
        path=os.path.abspath(out / BYTE_TOKENIZER_FILE),
        sha256=sha256_file(tmp / BYTE_TOKENIZER_FILE),
    )


def _check_output(out: Path, force: bool) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise KilnError(f"{out} already exists; pass --force to replace it")
    if not out.is_dir():
        raise KilnError(f"{out} exists and is not a directory")
    if any(out.iterdir()) and not is_shard_dataset(out):
        # --force replaces datasets; it must not delete an unrelated directory by accident.
        raise KilnError(
            f"{out} exists and is not a kiln dataset (no {MANIFEST_NAME} of format "
            f"{MANIFEST_FORMAT!r}); refusing to replace it"
        )


def build_path(out: Path, kind: str) -> Path:
    """`.<out>.<pid>.<kind>.tmp` beside `out`: a folder of this process that a later start
    recognises as abandoned once the process is gone (see `remove_abandoned_builds`)."""
    return out.parent / f".{out.name}.{os.getpid()}.{kind}.tmp"


def remove_abandoned_builds(out: Path) -> list[Path]:
    """Clear what killed builds of `out` left: `.<out>.<pid>.*.tmp` folders of dead processes.

    One bearing our own PID is a dead predecessor's too (`kiln.folders.abandoned_by`): this runs
    before the build makes its own folder.

    One exception: when `out` is missing but such a process had moved the old dataset aside
    (`.<out>.<pid>.old.tmp`, killed between the two renames of `install_dataset`), that folder
    is moved back to `out` instead of being deleted. Returns the deleted folders.
    """
    if not out.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(\d+)\.([^.]+)\.tmp")
    abandoned: list[tuple[Path, str]] = []
    for path in sorted(out.parent.glob(f".{out.name}.*.tmp")):
        match = pattern.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink() and abandoned_by(int(match[1])):
            abandoned.append((path, match[2]))
    olds = [path for path, kind in abandoned if kind == "old"]
    if olds and not out.exists() and not out.is_symlink():
        kept = max(olds, key=lambda p: p.stat().st_mtime_ns)
        os.replace(kept, out)
        print(
            f"note: restored {out} from {kept.name}, where a replacement cut short had left it",
            file=sys.stderr,
        )
        abandoned = [(path, kind) for path, kind in abandoned if path != kept]
    for path, _ in abandoned:
        shutil.rmtree(path, ignore_errors=True)
    return [path for path, _ in abandoned]


def install_dataset(tmp: Path, out: Path) -> None:
    """Move the finished dataset into place; an old one is renamed away, then deleted.

    SIGINT/SIGTERM wait while the two renames run, so `out` is never left missing by them; a
    SIGKILL between them leaves the old dataset in `.<out>.<pid>.old.tmp`, which the next start
    moves back (`remove_abandoned_builds`), as it deletes one a kill during the deletion left.
    """
    old = build_path(out, "old")
    moved = False
    try:
        with interrupts_deferred():
            if out.exists() or out.is_symlink():
                if old.exists():
                    shutil.rmtree(old)
                os.replace(out, old)
                moved = True
            kill_point("install:between-renames")
            try:
                os.replace(tmp, out)
            except BaseException:
                if moved:
                    os.replace(old, out)
                    moved = False
                raise
    finally:
        if moved and old.is_symlink():
            old.unlink()  # `out` was a link to a dataset: the link is replaced, not its target
        elif moved:
            shutil.rmtree(old, ignore_errors=True)


def tokenize_to_shards(config: TokenizeConfig) -> Manifest:
    """Encode `config.inputs` into a token-shard dataset at `config.out`; return its manifest."""
    out = Path(config.out)
    remove_abandoned_builds(out)  # first: it may move back a dataset a killed run had set aside
    _check_output(out, config.force)
    for path in config.inputs:
        if not os.path.isfile(path):
            raise not_found(path, "input file")
    tok, tok_entry = _load_tokenizer(config)
    dtype = dtype_for_vocab(tok.n_vocab)
    total = _count_documents(config)
    if total == 0:
        raise KilnError(f"no documents found in {', '.join(config.inputs)}")
    n_val = config.n_val(total)
    # The val split is a seeded sample of whole documents, independent of how they are batched.
    val_index = np.sort(np.random.default_rng(config.seed).choice(total, n_val, replace=False))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".tmp", dir=out.parent)
    )
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the dataset gets a plain mkdir's mode
    writers: dict[str, ShardWriter] = {}
    try:
        tallies = [_SourceTally() for _ in config.inputs]
        tok_entry = with_byte_tokenizer(tok, tok_entry, tmp, out)
        writers = {s: ShardWriter(tmp, s, dtype, config.shard_tokens) for s in SPLITS}
        tok_path = tmp / BYTE_TOKENIZER_FILE if config.tokenizer == BYTES else config.tokenizer
        _encode_all(config, tok, tok_path, dtype, val_index, tallies, writers, total)
        manifest = Manifest(
            tokenizer=tok_entry,
            dtype=dtype_name(dtype),
            splits={s: w.close() for s, w in writers.items()},
            sources=tuple(_source_entry(p, t) for p, t in zip(config.inputs, tallies, strict=True)),
            config={**asdict(config), "inputs": [os.path.abspath(p) for p in config.inputs]},
            created=creation_time(),
            kiln_version=__version__,
        )
        manifest.write(tmp)
        install_dataset(tmp, out)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _source_entry(path: str, tally: _SourceTally) -> SourceEntry:
    return SourceEntry(
        path=os.path.abspath(path),
        documents=tally.documents,
        tokens=tally.tokens,
        empty_skipped=tally.counts.empty_skipped,
        invalid_utf8_documents=tally.counts.invalid_utf8_documents,
        inline_separators=tally.counts.inline_separators,
        invalid_utf8_first=tally.counts.invalid_utf8_first,
    )


def _pool_context() -> multiprocessing.context.BaseContext:
    """fork on Linux: spawn and forkserver re-import the caller's __main__, which fails for
    scripts without a main guard, notebooks and stdin; the workers only encode text, which
    does not depend on threads or locks inherited from the parent."""
    if sys.platform == "linux":
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _encode_all(
    config: TokenizeConfig,
    tok: Tokenizer,
    tok_path: str | Path,
    dtype: np.dtype,
    val_index: np.ndarray,
    tallies: list[_SourceTally],
    writers: dict[str, ShardWriter],
    total: int,
) -> None:
    """Encode every batch (in a process pool for large inputs) and write results in order."""
    workers = config.workers or os.cpu_count() or 1
    input_bytes = sum(os.path.getsize(p) for p in config.inputs)
    parallel = workers > 1 and input_bytes >= config.parallel_min_bytes
    bar = tqdm(
        total=total, unit="doc", desc="tokenize", disable=not config.progress, dynamic_ncols=True
    )
    started, n_tokens = time.perf_counter(), 0
    tokenizer_path = os.path.abspath(tok_path)
    eot_id = tok.special_tokens[config.eot_token]

    def write(batch: _Batch, flat: np.ndarray, lengths: np.ndarray) -> None:
        nonlocal n_tokens
        ends = np.cumsum(lengths)
        for i, (end, n) in enumerate(zip(ends, lengths, strict=True)):
            split = "val" if batch.is_val[i] else "train"
            writers[split].add(flat[end - n : end], batch.sources[i])
            tallies[batch.sources[i]].documents[split] += 1
            tallies[batch.sources[i]].tokens[split] += int(n)
        n_tokens += int(flat.shape[0])
        bar.update(len(batch.texts))
        rate = n_tokens / max(time.perf_counter() - started, 1e-9)
        bar.set_postfix(tokens=f"{n_tokens:,}", tok_per_s=f"{rate:,.0f}", refresh=False)

    batches = _iter_batches(config, val_index, tallies)
    try:
        if not parallel:
            for batch in batches:
                write(batch, *encode_documents(tok, batch.texts, eot_id, dtype, threads=workers))
            return
        pool = ProcessPoolExecutor(
            workers, mp_context=_pool_context(), initializer=worker_init, initargs=(os.getpid(),)
        )
        try:
            # A bounded queue of batches in flight keeps memory flat and output in input order.
            pending: deque[tuple[_Batch, Future[tuple[np.ndarray, np.ndarray]]]] = deque()
            for batch in batches:
                future = pool.submit(_encode_in_worker, tokenizer_path, batch.texts, eot_id, dtype)
                pending.append((batch, future))
                if len(pending) >= 2 * workers:
                    done, fut = pending.popleft()
                    write(done, *fut.result())
            while pending:
                done, fut = pending.popleft()
                write(done, *fut.result())
        except BaseException:
            stop_pool(pool)  # don't wait for batches whose output is discarded anyway
            raise
        pool.shutdown()
    finally:
        bar.close()
