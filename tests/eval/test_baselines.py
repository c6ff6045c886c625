"""The ladder's count and small neural baselines: Kneser–Ney equals NLTK's, distributions are
proper, the count path's bits per byte is the speedrun's, and `kiln baselines` runs end to end."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
from kiln.eval.baselines.counts import NO_TOKEN, AddKBigram, KneserNey, window_contexts
from kiln.eval.baselines.ladder import NeuralSettings, count_nats, run_rung
from kiln.eval.lm import encode_stream, stream_bits_per_byte
from kiln.eval.scoring import Scorer, rolling_windows
from kiln.model.baselines import BaselineConfig, LearnedBigram, NGramMLP
from kiln.tokenizer import Tokenizer
from tests.fixtures import require_shared

from .conftest import ASSET, EOT

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _words() -> tuple[list[str], list[str], np.ndarray]:
    text = require_shared(SHARED / "text" / "tinystories_sample.txt").read_text()
    words = text.split()[:500]
    vocab = sorted(set(words))
    index = {w: i for i, w in enumerate(vocab)}
    return words, vocab, np.array([index[w] for w in words])


@pytest.mark.parametrize("order", [2, 3, 4])
def test_kneser_ney_equals_nltk_on_the_same_text(order: int) -> None:
    from nltk.lm import KneserNeyInterpolated
    from nltk.util import everygrams

    words, vocab, ids = _words()
    ref = KneserNeyInterpolated(order, discount=0.75)
    ref.fit([list(everygrams(words, max_len=order))], vocabulary_text=words)
    ours = KneserNey(len(vocab), order, 0.75, uniform_floor=False).fit(ids)
    rng = np.random.default_rng(order)
    contexts, targets, expected = [], [], []
    for i in range(400):  # seen n-grams, seen contexts with other words, unseen contexts
        at = int(rng.integers(order, len(ids)))
        ctx = ids[at - order + 1 : at] if i % 3 else rng.integers(0, len(vocab), order - 1)
        word = ids[at] if i % 2 else int(rng.integers(0, len(vocab)))
        try:
            expected.append(ref.score(vocab[word], [vocab[c] for c in ctx]))
        except ZeroDivisionError:  # NLTK divides by zero for a context only seen at the start
            continue
        contexts.append(ctx)
        targets.append(word)
    got = np.exp(ours.logprob(np.array(contexts), np.array(targets)))
    assert len(expected) > 300
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)
    assert len({round(p, 9) for p in expected}) > 50  # the comparison sees many distinct values


def _full_rows(model: AddKBigram | KneserNey, contexts: np.ndarray) -> np.ndarray:
    V = model.vocab
    rows = np.repeat(contexts, V, axis=0)
    return np.exp(model.logprob(rows, np.tile(np.arange(V), len(contexts)))).reshape(-1, V)


def test_count_models_give_proper_distributions_even_for_unseen_contexts() -> None:
    _, vocab, ids = _words()
    V = len(vocab) + 5  # five tokens the text never uses
    rng = np.random.default_rng(0)
    contexts = rng.integers(0, V, (20, 3))
    contexts[:5, :2] = NO_TOKEN  # short contexts: the start of a stream or window
    contexts[5:10] = np.stack([ids[i : i + 3] for i in range(5, 10)])  # seen contexts
    for model in (KneserNey(V, 4, 0.75).fit(ids), AddKBigram(V, 0.1).fit(ids)):
        ctx = contexts if model.order == 4 else contexts[:, -1:]
        rows = _full_rows(model, ctx)
        np.testing.assert_allclose(rows.sum(axis=1), 1.0, rtol=1e-9)
        assert (rows > 0).all()  # the uniform floor: no token is impossible
    # without the floor, a token never seen as a continuation has probability 0 (NLTK's case)
    bare = _full_rows(KneserNey(V, 4, 0.75, uniform_floor=False).fit(ids), contexts)
    assert (bare == 0).any()


def test_window_contexts_never_reach_before_their_scoring_window() -> None:
    ids = np.arange(100, 160)
    windows = rolling_windows(len(ids), 8, 8)
    contexts, targets = window_contexts(ids, 3, windows)
    assert len(targets) == len(ids) - 1 and (targets == ids[1:]).all()
    for (lo, hi, n), start in zip(windows, np.cumsum([0] + [w[2] for w in windows]), strict=False):
        for row in range(start, start + n):
            pos = hi - n + row - start
            want = [ids[p] if p >= lo else NO_TOKEN for p in range(pos - 3, pos)]
            assert contexts[row].tolist() == want


def test_count_bits_per_byte_is_the_speedruns(tmp_path: Path) -> None:
    # A learned bigram holding the count bigram's log-probabilities is the same model: scored
    # through stream_bits_per_byte it must give what the count path computes.
    tok = Tokenizer.raw_bytes()
    with gzip.open(ASSET, "rt", encoding="utf-8") as handle:
        text = handle.read(6000)
    path = tmp_path / "valid.txt"
    path.write_text(text[: text.rfind(EOT) + len(EOT)], encoding="utf-8")
    stream = encode_stream(tok, path, 256)
    ids = np.asarray(stream.ids)
    counts = AddKBigram(257, 0.5).fit(ids[: len(ids) // 2])
    table = _full_rows(counts, np.arange(257)[:, None])
    neural = LearnedBigram(BaselineConfig("bigram", 257, block_size=64))
    with torch.no_grad():
        neural.table.weight.copy_(torch.as_tensor(np.log(table)))
    scored = stream_bits_per_byte(Scorer(neural, progress=False), tok, path, 256)
    nats, n = count_nats(counts, ids, 64)
    assert n == scored.n_tokens == len(ids) - 1
    assert nats / (math.log(2) * stream.n_bytes) == pytest.approx(
        scored.bits_per_byte, rel=1e-6
    )  # fp32 logits


def test_the_mlp_sees_only_its_context() -> None:
    model = NGramMLP(BaselineConfig("mlp", 50, context=3, hidden=16))
    torch.nn.init.normal_(model.head.weight)
    x = torch.randint(0, 50, (1, 12))
    y = x.clone()
    y[0, 2] = (y[0, 2] + 1) % 50  # position 2 is context of positions 2, 3, 4 only
    changed = (model.logits(model.hidden(x)) - model.logits(model.hidden(y))).abs().sum(-1)[0]
    assert changed[2:5].min() > 0 and changed[:2].max() == 0 and changed[5:].max() == 0


@pytest.fixture(scope="module")
def byte_stories(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """About 30 KB of the embedded stories as byte shards, and the next 6 KB as a valid file."""
    root = tmp_path_factory.mktemp("ladder")
    with gzip.open(ASSET, "rt", encoding="utf-8") as handle:
        text = handle.read(36_000)
    cut = text.rfind(EOT, 0, 30_000) + len(EOT)
    (root / "train.txt").write_text(text[:cut], encoding="utf-8")
    valid = text[cut:]
    (root / "valid.txt").write_text(valid[: valid.rfind(EOT) + len(EOT)], encoding="utf-8")
    tokenize_to_shards(
        TokenizeConfig(tokenizer="bytes", inputs=(str(root / "train.txt"),),
                       out=str(root / "ds"), val_docs=3, workers=1, progress=False)
    )  # fmt: skip
    return root / "ds", root / "valid.txt"


def test_kneser_ney_beats_the_bigram_and_both_beat_the_uniform(
    byte_stories: tuple[Path, Path],
) -> None:
    ds, valid = byte_stories
    bigram = run_rung("bigram", ds, valid, block_size=64)
    kn = run_rung("kn", ds, valid, block_size=64)
    assert kn.valid_bpb < bigram.valid_bpb < math.log2(257) * 0.9
    assert kn.settings["order"] >= 3 and bigram.n_tokens == kn.n_tokens


def test_kiln_baselines_runs_every_rung_and_writes_json(
    byte_stories: tuple[Path, Path], tmp_path: Path
) -> None:
    ds, valid = byte_stories
    out = tmp_path / "ladder.json"
    cmd = [sys.executable, "-m", "kiln.cli", "baselines", str(ds), "--valid", str(valid),
           "--budget", "2", "--block-size", "64", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rungs = {r["rung"]: r for r in json.loads(out.read_text())["rungs"]}
    assert list(rungs) == ["bigram", "kn", "bigram-nn", "mlp"]
    for name in ("bigram-nn", "mlp"):  # trained: better than the uniform they start from
        assert rungs[name]["extra"]["steps"] > 0
        assert rungs[name]["valid_bpb"] < math.log2(257)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already exists; pass --force" in again.stderr


def test_neural_rung_stops_at_max_steps(byte_stories: tuple[Path, Path]) -> None:
    ds, valid = byte_stories
    res = run_rung("mlp", ds, valid, 64, NeuralSettings(budget_s=600, max_steps=3))
    assert res.extra["steps"] == 3 and res.extra["tokens"] == 3 * 32 * 128


def test_bad_rung_names_are_refused(byte_stories: tuple[Path, Path]) -> None:
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match="unknown baseline 'trigram'"):
        run_rung("trigram", *byte_stories)
