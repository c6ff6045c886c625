"""`train_bpe`: count pre-tokens over a streamed corpus, learn merges, checkpoint, report."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import resource
import shutil
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kiln import __version__
from kiln.errors import KilnError, not_found
from kiln.io import atomic_write, write_json_atomic
from kiln.tokenizer.corpus import Utf8Report, iter_segments
from kiln.tokenizer.merge_ref import ReferenceMergeEngine
from kiln.tokenizer.native import NATIVE
from kiln.tokenizer.patterns import SplitPattern, resolve_pattern
from kiln.tokenizer.pretokenize import count_pretokens
from kiln.tokenizer.tokenizer import Backend, Tokenizer

# Below this many input bytes, worker processes cost more than they save.
_PARALLEL_MIN_BYTES = 4 << 20
# Segments are handed to the counters in batches of about this many bytes.
_BATCH_BYTES = 32 << 20
_CHECKPOINT_SECONDS = 30.0

Callback = Callable[[str, int, int], None]


def _peak_rss_mb() -> float:
    """Peak resident memory of this process and its finished children, in MiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024.0


def _input_fingerprint(paths: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append({"path": os.path.abspath(p), "bytes": st.st_size, "mtime": int(st.st_mtime)})
    return out


def _count_batch_reference(args: tuple[list[bytes], str, tuple[str, ...]]) -> Counter[bytes]:
    segments, pattern_text, specials = args
    pattern = resolve_pattern(pattern_text)
    return count_pretokens((s.decode("utf-8") for s in segments), pattern, specials)


class _Counter:
    """Accumulates pre-token counts with the native engine or the reference one."""

    def __init__(self, pattern: SplitPattern, specials: Sequence[str], native: bool, workers: int):
        self.pattern, self.specials, self.workers = pattern, tuple(specials), workers
        self.native = (
            NATIVE.PretokenCounter(pattern.name, [s.encode() for s in specials])
            if (native and pattern.is_builtin)
            else None
        )
        self.counts: Counter[bytes] = Counter()
        self._pool: ProcessPoolExecutor | None = None
        self._pending: list[Any] = []

    def add(self, batch: list[bytes], parallel: bool) -> None:
        if self.native is not None:
            self.native.add(batch, self.workers if parallel else 1)
            return
        if not parallel or self.workers <= 1:
            self.counts.update(_count_batch_reference((batch, self.pattern.text, self.specials)))
            return
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers)
        # Split the batch so every worker gets a share; keep a bounded number in flight.
        share = max(1, len(batch) // self.workers)
        for i in range(0, len(batch), share):
            job = (batch[i : i + share], self.pattern.text, self.specials)
            self._pending.append(self._pool.submit(_count_batch_reference, job))
        while len(self._pending) > 2 * self.workers:
            self.counts.update(self._pending.pop(0).result())

    def finish(self, min_frequency: int) -> tuple[list[bytes], list[int], int, int]:
        """Sorted unique words and counts kept, plus the number and occurrences pruned."""
        if self.native is not None:
            words, counts, pruned, pruned_occ = self.native.items(min_frequency)
            return list(words), list(counts), pruned, pruned_occ
        for fut in self._pending:
            self.counts.update(fut.result())
        if self._pool is not None:
            self._pool.shutdown()
        kept = sorted((w, c) for w, c in self.counts.items() if c >= min_frequency)
        pruned = len(self.counts) - len(kept)
        pruned_occ = sum(self.counts.values()) - sum(c for _, c in kept)
        return [w for w, _ in kept], [c for _, c in kept], pruned, pruned_occ


class _State:
    """The on-disk training state that makes `resume` possible."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def params_path(self) -> Path:
        return self.dir / "params.json"

    def save_counts(
        self,
        params: dict[str, Any],
        words: list[bytes],
        counts: list[int],
        stats: dict[str, Any],
        held: list[bytes],
    ) -> None:
        """Save the counting phase's result; params.json, written last, marks it complete."""
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            self.dir / "count_stats.json", {**stats, "holdout_hex": [h.hex() for h in held]}
        )
        lengths = np.fromiter((len(w) for w in words), dtype=np.int64, count=len(words))
        with atomic_write(self.dir / "counts.npz", "wb") as handle:
            np.savez(
                handle,
                blob=np.frombuffer(b"".join(words), dtype=np.uint8),
                lengths=lengths,
                counts=np.asarray(counts, dtype=np.int64),
            )
        self.save_merges([])
        write_json_atomic(self.params_path(), params)

    def load(
        self, params: dict[str, Any]
    ) -> tuple[list[bytes], list[int], dict[str, Any], list[bytes], list[tuple[int, int]]]:
        """Counts, count stats, held-out slice and merges so far, if saved with these params."""
        saved = json.loads(self.params_path().read_text())
        if saved != params:
            diff = sorted(k for k in set(saved) | set(params) if saved.get(k) != params.get(k))
            raise KilnError(
                f"{self.dir}: saved training state was made with different settings ({diff}); "
                "remove it or train without --resume"
            )
        with np.load(self.dir / "counts.npz") as data:
            blob, lengths, counts = data["blob"].tobytes(), data["lengths"], data["counts"]
        ends = np.cumsum(lengths)
        starts = ends - lengths
        words = [blob[s:e] for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
        merges = [tuple(m) for m in json.loads((self.dir / "merges.json").read_text())]
        stats = json.loads((self.dir / "count_stats.json").read_text())
        held = [bytes.fromhex(h) for h in stats.pop("holdout_hex", [])]
        return words, counts.tolist(), stats, held, merges  # type: ignore[return-value]

    def save_merges(self, merges: list[tuple[int, int]]) -> None:
        write_json_atomic(self.dir / "merges.json", [list(m) for m in merges], indent=None)

    def exists(self) -> bool:
        return (self.dir / "counts.npz").exists() and self.params_path().exists()


def _resolve_backend(backend: Backend) -> bool:
    if backend == "native" and NATIVE is None:
        raise KilnError("backend='native' requested but the native extension is not built")
    return backend != "reference" and NATIVE is not None


def _count_phase(
    inputs: Sequence[str],
    pattern: SplitPattern,
    specials: Sequence[str],
    workers: int,
    native: bool,
    *,
    text_field: str,
    strict_utf8: bool,
    holdout: float,
    min_frequency: int,
    progress: bool,
    callback: Callback | None,
) -> tuple[list[bytes], list[int], dict[str, Any], list[bytes]]:
    total_bytes = sum(os.path.getsize(p) for p in inputs)
    parallel = workers > 1 and total_bytes >= _PARALLEL_MIN_BYTES
    counter = _Counter(pattern, specials, native, workers)
    report = Utf8Report()
    bar = tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="count pre-tokens", disable=not progress
    )
    holdout_budget = int(total_bytes * holdout)
    held: list[bytes] = []
    batch: list[bytes] = []
    batch_bytes = seen = 0
    # Smaller blocks for small corpora, so the held-out slice can be spread over the corpus.
    block_bytes = min(1 << 20, max(1 << 12, total_bytes // 200))
    try:  # a bad input ends the bar first, so the error starts on its own line
        for segment in iter_segments(
            inputs,
            specials,
            pattern.is_builtin,
            block_bytes=block_bytes,
            text_field=text_field,
            strict_utf8=strict_utf8,
            report=report,
            on_progress=bar.update,
        ):
            # The held-out slice is every 50th segment until the budget is spent: spread over the
            # corpus rather than taken from its head.
            seen += 1
            if holdout_budget > 0 and seen % 50 == 0:
                held.append(segment)
                holdout_budget -= len(segment)
                continue
            batch.append(segment)
            batch_bytes += len(segment)
            if batch_bytes >= _BATCH_BYTES:
                counter.add(batch, parallel)
                if callback:
                    callback("count", bar.n, total_bytes)
                batch, batch_bytes = [], 0
    finally:
        bar.close()
    if batch:
        counter.add(batch, parallel)
    words, counts, pruned, pruned_occ = counter.finish(min_frequency)
    if not words:
        raise KilnError(
            f"the corpus has no text to learn from ({', '.join(map(str, inputs))}): "
            "it is empty, or only special tokens, or every pre-token fell below --min-frequency"
        )
    stats = {
        "input_bytes_on_disk": total_bytes,
        "unique_pretokens": len(words) + pruned,
        "kept_pretokens": len(words),
        "pruned_pretokens": pruned,
        "pruned_occurrences": pruned_occ,
        "pretoken_occurrences": int(sum(counts)) + pruned_occ,
        "invalid_utf8": report.summary() or None,
        "parallel_counting": parallel,
    }
    return words, counts, stats, held


def _merge_phase(
    engine: Any,
    merges: list[tuple[int, int]],
    vocab_target: int,
    state: _State | None,
    progress: bool,
    callback: Callback | None,
) -> list[tuple[int, int]]:
    bar = tqdm(total=vocab_target - 256, desc="learn merges", unit="merge", disable=not progress)
    bar.update(engine.vocab_size - 256)
    last_save = time.monotonic()
    chunk = 64
    try:
        while engine.vocab_size < vocab_target:
            before = engine.vocab_size
            step = engine.step(chunk, vocab_target)
            if not step:
                break
            merges.extend(step)
            bar.update(engine.vocab_size - before)
            if callback:
                callback("merge", engine.vocab_size, vocab_target)
            if state is not None and time.monotonic() - last_save > _CHECKPOINT_SECONDS:
                state.save_merges(merges)
                last_save = time.monotonic()
    except KeyboardInterrupt:
        # Ctrl-C keeps every merge learned so far, so --resume starts from here.
        if state is not None:
            state.save_merges(merges)
        raise
    finally:
        bar.close()
    return merges


def train_bpe(
    inputs: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    vocab_size: int,
    special_tokens: Sequence[str] = (),
    pattern: str = "gpt2",
    workers: int | None = None,
    *,
    min_frequency: int = 1,
    text_field: str = "text",
    invalid_utf8: str = "replace",
    holdout: float = 0.0,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    resume: bool = False,
    keep_checkpoint: bool = False,
    progress: bool = False,
    backend: Backend = "auto",
    callback: Callback | None = None,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on text files; `metadata["training"]` holds the report."""
    t_start = time.perf_counter()
    paths = [os.fspath(p) for p in ([inputs] if isinstance(inputs, str | os.PathLike) else inputs)]
    if not paths:
        raise KilnError("no input files given")
    for p in paths:
        if not os.path.isfile(p):
            raise not_found(p, "file")
    specials = list(dict.fromkeys(special_tokens))
    if any(not isinstance(s, str) or not s for s in specials):
        raise KilnError(f"special tokens must be non-empty strings, got {specials!r}")
    if vocab_size < 256 + len(specials):
        raise KilnError(
            f"vocab_size {vocab_size} is too small: it must be at least 256 (the byte values) "
            f"+ {len(specials)} special token(s) = {256 + len(specials)}"
        )
    if invalid_utf8 not in ("replace", "error"):
        raise KilnError(f"invalid_utf8 must be 'replace' or 'error', got {invalid_utf8!r}")
    if not 0.0 <= holdout < 0.5:
        raise KilnError(f"holdout must be a fraction in [0, 0.5), got {holdout}")
    if min_frequency < 1:
        raise KilnError(f"min_frequency must be >= 1, got {min_frequency}")
    split = resolve_pattern(pattern)
    native = _resolve_backend(backend)
    workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    params = {
        "inputs": _input_fingerprint(paths),
        "vocab_size": vocab_size,
        "special_tokens": specials,
        "pattern": split.text,
        "min_frequency": min_frequency,
        "text_field": text_field,
        "invalid_utf8": invalid_utf8,
        "holdout": holdout,
    }
    state = _State(Path(checkpoint_dir)) if checkpoint_dir is not None else None
    timings: dict[str, float] = {}
    merges: list[tuple[int, int]] = []
    held: list[bytes] = []
    if state is not None and resume and state.exists():
        t0 = time.perf_counter()
        words, counts, count_stats, held, merges = state.load(params)
        timings["load_state_s"] = time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        words, counts, count_stats, held = _count_phase(
            paths,
            split,
            specials,
            workers,
            native,
            text_field=text_field,
            strict_utf8=invalid_utf8 == "error",
            holdout=holdout,
            min_frequency=min_frequency,
            progress=progress,
            callback=callback,
        )
        timings["count_s"] = time.perf_counter() - t0
        if state is not None:
            state.save_counts(params, words, counts, count_stats, held)
    t0 = time.perf_counter()
    engine = (NATIVE.MergeEngine if native else ReferenceMergeEngine)(words, counts)
    for a, b in merges:
        engine.apply(a, b)  # replay a resumed run's merges: same state as when it stopped
    del words, counts
    merges = _merge_phase(engine, merges, vocab_size - len(specials), state, progress, callback)
    timings["merge_s"] = time.perf_counter() - t0
    if engine.vocab_size < vocab_size - len(specials):
        warnings.warn(
            f"the corpus ran out of pairs to merge: the tokenizer has "
            f"{engine.vocab_size + len(specials):,} tokens, not the {vocab_size:,} asked for",
            RuntimeWarning,
            stacklevel=2,
        )
    tok = _build_tokenizer(engine, merges, specials, split, backend)
    t0 = time.perf_counter()
    training = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "kiln_version": __version__,
        "python": platform.python_version(),
        "backend": "native" if native else "reference",
        "workers": workers,
        "params": params,
        "corpus_sha256": _corpus_digest(params["inputs"]),
        "vocab_size": tok.n_vocab,
        "merges": len(merges),
        **count_stats,
        **_compression(tok, held),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }
    timings["report_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    training["timings"] = {k: round(v, 3) for k, v in timings.items()}
    tok.metadata["training"] = training
    if state is not None and not keep_checkpoint:
        shutil.rmtree(state.dir, ignore_errors=True)
    return tok


def _corpus_digest(fingerprint: list[dict[str, Any]]) -> str:
    """sha256 over the input files' bytes, in order (what was trained on, exactly)."""
    digest = hashlib.sha256()
    for entry in fingerprint:
        with open(entry["path"], "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def _build_tokenizer(
    engine: Any,
    merges: list[tuple[int, int]],
    specials: list[str],
    pattern: SplitPattern,
    backend: Backend,
) -> Tokenizer:
    vocab = {i: engine.token(i) for i in range(engine.vocab_size)}
    merge_bytes = [(vocab[a], vocab[b]) for a, b in merges]
    special_map = {s: engine.vocab_size + k for k, s in enumerate(specials)}
    return Tokenizer(vocab, merge_bytes, special_map, pattern, backend=backend)


def _compression(tok: Tokenizer, held: list[bytes]) -> dict[str, Any]:
    """UTF-8 bytes per token on the held-out slice (empty when no slice was held out)."""
    if not held:
        return {"holdout_bytes": 0, "holdout_bytes_per_token": None}
    n_bytes = sum(len(h) for h in held)
    n_tokens = sum(
        len(ids)
        for ids in tok.encode_batch([h.decode("utf-8") for h in held], allowed_special="all")
    )
    return {
        "holdout_bytes": n_bytes,
        "holdout_bytes_per_token": round(n_bytes / max(1, n_tokens), 4),
    }


def format_report(training: dict[str, Any]) -> str:
    """A human-readable summary of a training run's metadata."""
    t = training.get("timings", {})
    lines = [
        f"vocab size        {training['vocab_size']:,} ({training['merges']:,} merges, "
        f"{len(training['params']['special_tokens'])} special)",
        f"pattern           {training['params']['pattern'][:60]}",
        f"input             {training['input_bytes_on_disk']:,} bytes on disk, "
        f"{training['pretoken_occurrences']:,} pre-tokens",
        f"unique pre-tokens {training['unique_pretokens']:,} "
        f"({training['pruned_pretokens']:,} pruned below min_frequency, "
        f"{training['pruned_occurrences']:,} occurrences)",
        "time              " + ", ".join(f"{k.removesuffix('_s')} {v:.2f}s" for k, v in t.items()),
        f"peak memory       {training['peak_rss_mb']:,.0f} MiB "
        f"(backend {training['backend']}, {training['workers']} workers)",
    ]
    if training.get("holdout_bytes"):
        lines.append(
            f"compression       {training['holdout_bytes_per_token']:.3f} bytes/token on a "
            f"{training['holdout_bytes']:,}-byte held-out slice"
        )
    if training.get("invalid_utf8"):
        lines.append(f"invalid UTF-8     {training['invalid_utf8']} (replaced with U+FFFD)")
    return "\n".join(lines)


def iter_files(paths: Iterable[str]) -> list[str]:
    """Expand directories into the files they contain (sorted), for the CLI."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            out.extend(sorted(str(q) for q in Path(p).rglob("*") if q.is_file()))
        else:
            out.append(p)
    return out
