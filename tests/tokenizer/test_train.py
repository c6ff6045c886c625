"""Training: exact parity with a naive trainer, worker-count independence, resume, bad input."""

from __future__ import annotations

import functools
import gzip
import json

import pytest

from kiln.errors import KilnError
from kiln.tokenizer import Tokenizer, train_bpe
from kiln.tokenizer.native import NATIVE
from kiln.tokenizer.patterns import NAMED_PATTERNS

from .naive_bpe import naive_train

BACKENDS = ["reference"] + (["native"] if NATIVE is not None else [])
EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def small_corpus(shared_data, tmp_path_factory):
    """The CS336 fixture texts joined by end-of-text tokens (about 140 KB)."""
    parts = [
        (shared_data / "text" / name).read_text(encoding="utf-8")
        for name in ("tinystories_sample.txt", "address.txt", "german.txt", "corpus.en")
    ]
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text(EOT.join(parts), encoding="utf-8")
    return path


@functools.lru_cache(maxsize=8)
def _naive_cached(text: str, vocab_size: int, pattern: str) -> list[tuple[bytes, bytes]]:
    return naive_train(text, vocab_size, [EOT], NAMED_PATTERNS[pattern])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("vocab_size", "pattern"), [(300, "gpt2"), (600, "gpt2"), (450, "cl100k"), (400, "o200k")]
)
def test_matches_naive_trainer(small_corpus, backend, vocab_size, pattern) -> None:
    text = small_corpus.read_text(encoding="utf-8")
    expected = _naive_cached(text, vocab_size, pattern)
    tok = train_bpe([small_corpus], vocab_size, [EOT], pattern=pattern, backend=backend, workers=1)
    assert tok.merges == expected
    assert tok.n_vocab == vocab_size
    assert tok.special_tokens == {EOT: vocab_size - 1}


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_worker_count_does_not_change_result(shared_data, backend, workers, monkeypatch) -> None:
    import kiln.tokenizer.train as train_mod

    # Force the parallel path even on this small input.
    monkeypatch.setattr(train_mod, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(train_mod, "_BATCH_BYTES", 64 << 10)
    path = shared_data / "tinystories" / "valid.txt.gz"
    tok = train_bpe([path], 700, [EOT], workers=workers, backend=backend)
    baseline = train_bpe([path], 700, [EOT], workers=1, backend="reference")
    assert tok.merges == baseline.merges
    assert tok.vocab == baseline.vocab


def test_native_and_reference_agree_on_multilingual_text(shared_data, tmp_path) -> None:
    if NATIVE is None:
        pytest.skip("native extension not built")
    with gzip.open(shared_data / "bench" / "multi_10m.txt.gz", "rb") as f:
        data = f.read(300_000)
    path = tmp_path / "multi.txt"
    path.write_bytes(data[: data.rfind(b"\n") + 1])
    for pattern in ("gpt2", "o200k"):
        a = train_bpe([path], 1200, [EOT], pattern=pattern, backend="native")
        b = train_bpe([path], 1200, [EOT], pattern=pattern, backend="reference")
        assert a.merges == b.merges, pattern


def test_resume_equals_uninterrupted(small_corpus, tmp_path, monkeypatch) -> None:
    import kiln.tokenizer.train as train_mod

    state = tmp_path / "state"
    full = train_bpe([small_corpus], 900, [EOT])

    def interrupt(phase: str, done: int, total: int) -> None:
        if phase == "merge" and done > 500:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_bpe([small_corpus], 900, [EOT], checkpoint_dir=state, callback=interrupt)
    saved = json.loads((state / "merges.json").read_text())
    assert 500 - 256 <= len(saved) < 900 - 257  # the interrupt saved what was learned

    def no_recount(*args: object, **kwargs: object) -> None:
        raise AssertionError("the resumed run counted the corpus again")

    # A resume that silently retrained would give the same merges: prove it started from the
    # saved state (no counting phase, neither run nor timed) and went on from the saved merges.
    monkeypatch.setattr(train_mod, "_count_phase", no_recount)
    resumed = train_bpe([small_corpus], 900, [EOT], checkpoint_dir=state, resume=True)
    assert resumed.merges == full.merges
    timings = resumed.metadata["training"]["timings"]
    assert "load_state_s" in timings and "count_s" not in timings
    # The saved merges (engine ids: bytes 0-255, then one id per merge) lead the final list.
    pieces = {i: bytes([i]) for i in range(256)}
    for k, (a, b) in enumerate(saved):
        pieces[256 + k] = pieces[a] + pieces[b]
    assert resumed.merges[: len(saved)] == [(pieces[a], pieces[b]) for a, b in saved]
    assert not state.exists()  # cleaned up after success


def test_resume_with_other_settings_is_refused(small_corpus, tmp_path) -> None:
    state = tmp_path / "state"
    train_bpe([small_corpus], 300, [EOT], checkpoint_dir=state, keep_checkpoint=True)
    with pytest.raises(KilnError, match="different settings"):
        train_bpe([small_corpus], 400, [EOT], checkpoint_dir=state, resume=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_specials_are_never_merged(tmp_path, backend) -> None:
    path = tmp_path / "c.txt"
    path.write_text(("abc abd<|endoftext|>" * 50) + "<|end|>ab", encoding="utf-8")
    tok = train_bpe([path], 262, [EOT, "<|end|>"], backend=backend)
    assert len(tok.merges) == 4
    # "<" and "|" occur only inside the special tokens, so no merge may contain them.
    assert all(b"<" not in a + b and b"|" not in a + b for a, b in tok.merges)
    assert tok.encode("ab<|end|>", allowed_special="all")[-1] == tok.special_tokens["<|end|>"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_jsonl_and_compressed_inputs(tmp_path, backend) -> None:
    import zstandard

    docs = [f"document number {i} says hello to the world" for i in range(200)]
    jsonl = tmp_path / "docs.jsonl.zst"
    jsonl.write_bytes(
        zstandard.ZstdCompressor().compress(
            "\n".join(json.dumps({"text": d}) for d in docs).encode()
        )
    )
    txt = tmp_path / "docs.txt.gz"
    with gzip.open(txt, "wt", encoding="utf-8") as f:
        f.write(EOT.join(docs))
    a = train_bpe([jsonl], 320, [EOT], backend=backend)
    b = train_bpe([txt], 320, [EOT], backend=backend)
    assert a.merges == b.merges


def test_small_jobs_stay_in_process(small_corpus, monkeypatch) -> None:
    import concurrent.futures

    def forbidden(*args, **kwargs):
        raise AssertionError("a process pool was started for a small input")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", forbidden)
    import kiln.tokenizer.train as train_mod

    monkeypatch.setattr(train_mod, "ProcessPoolExecutor", forbidden)
    tok = train_bpe([small_corpus], 500, [EOT], workers=2, backend="reference")
    assert len(tok.merges) == 500 - 257


def test_invalid_utf8_is_reported_and_replaced(tmp_path) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello world\nbad \xff\xfe bytes here\n")
    with pytest.warns(
        UnicodeWarning,
        match=r"bad.txt: 2 invalid UTF-8 sequence\(s\), first at byte offset 16, byte offset 17",
    ):
        tok = train_bpe([path], 260, [])
    assert tok.metadata["training"]["invalid_utf8"]
    with pytest.raises(KilnError, match=r"bad.txt: invalid UTF-8 at byte offset 16"):
        train_bpe([path], 260, [], invalid_utf8="error")


def test_bad_arguments_give_clear_errors(tmp_path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(KilnError, match="no text to learn from"):
        train_bpe([empty], 300, [EOT])
    only_special = tmp_path / "special.txt"
    only_special.write_text(EOT * 3)
    with pytest.raises(KilnError, match="no text to learn from"):
        train_bpe([only_special], 300, [EOT])
    with pytest.raises(KilnError, match="at least 256"):
        train_bpe([empty], 256, [EOT])
    with pytest.raises(KilnError, match="no such file"):
        train_bpe([tmp_path / "missing.txt"], 300)
    with pytest.raises(KilnError, match="valid regex"):
        train_bpe([empty], 300, pattern="(unclosed")


def test_vocab_stops_early_when_corpus_is_exhausted(tmp_path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_text("abc abc", encoding="utf-8")
    with pytest.warns(RuntimeWarning, match="ran out of pairs"):
        tok = train_bpe([path], 10_000, [EOT])
    # Pairs run out long before 10k tokens: the tokenizer is smaller, and says so.
    assert tok.n_vocab < 300
    assert isinstance(tok, Tokenizer)


def test_summary_reports_phases_and_holdout(shared_data) -> None:
    from kiln.tokenizer.train import format_report

    tok = train_bpe([shared_data / "tinystories" / "valid.txt.gz"], 1000, [EOT], holdout=0.02)
    report = tok.metadata["training"]
    assert report["holdout_bytes"] > 0
    assert 2.0 < report["holdout_bytes_per_token"] < 6.0
    assert report["unique_pretokens"] >= report["kept_pretokens"] > 0
    text = format_report(report)
    assert "held-out" in text and "count" in text and "merge" in text


@pytest.mark.parametrize("pattern", ["gpt2", "cl100k", "o200k"])
def test_streaming_cuts_do_not_change_pretokens(tmp_path, pattern, monkeypatch) -> None:
    """Without special tokens the corpus is cut at newlines; tiny blocks force many cuts."""
    import kiln.tokenizer.train as train_mod

    lines = []
    for i in range(400):
        lines.append(f"Line {i}: it's  \n\n  \t\nWord{i}.\nnext {i * 7}\r\n  x\n\n")
    text = "".join(lines)
    path = tmp_path / "nospecial.txt"
    path.write_text(text, encoding="utf-8")
    expected = naive_train(text, 330, [], NAMED_PATTERNS[pattern])
    monkeypatch.setattr(train_mod, "_BATCH_BYTES", 1 << 10)
    from kiln.tokenizer import corpus

    real = corpus.iter_segments

    def tiny_blocks(*args, **kwargs):
        kwargs["block_bytes"] = 97
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "iter_segments", tiny_blocks)
    tok = train_bpe([path], 330, [], pattern=pattern)
    assert tok.merges == expected
