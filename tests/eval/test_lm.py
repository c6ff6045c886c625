"""Loss, perplexity and bits-per-byte equal direct computations over the same tokens."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.data.shard_reader import Dataset
from kiln.errors import KilnError
from kiln.eval.lm import bits_per_byte, stream_bits_per_byte, val_loss
from kiln.eval.scoring import Scorer
from kiln.model.transformer import Transformer
from kiln.tokenizer import Tokenizer

from .conftest import EOT, TEXT, random_tiny
from .test_scoring import direct_logprobs


def chunked_nats(model: Transformer, ids: list[int], block: int) -> float:
    """-sum log p over ids[1:], in disjoint windows of block+1 tokens (a multiple of block)."""
    assert (len(ids) - 1) % block == 0
    return -sum(
        float(direct_logprobs(model, ids[i : i + block + 1]).sum())
        for i in range(0, len(ids) - 1, block)
    )


def test_bits_per_byte_of_a_short_text(tmp_path: Path, tiny: Transformer, tok: Tokenizer) -> None:
    path = tmp_path / "fox.txt"
    path.write_text(TEXT, encoding="utf-8")
    eot = tok.special_tokens[EOT]
    result = bits_per_byte(Scorer(tiny, progress=False), tok, path, eot)
    ids = [eot, *tok.encode_ordinary(TEXT)]
    nats = -float(direct_logprobs(tiny, ids).sum())
    assert result.n_tokens == len(ids) - 1  # every text token, the first one too
    assert result.n_bytes == len(TEXT.encode("utf-8")) == len(TEXT) + 3  # the fox is 4 bytes
    assert result.bits_per_byte == pytest.approx(nats / (math.log(2) * result.n_bytes), rel=1e-5)
    assert result.loss == pytest.approx(nats / result.n_tokens, rel=1e-5)


def test_bits_per_byte_of_a_long_text_in_windows(tmp_path: Path, tok: Tokenizer) -> None:
    model = random_tiny(block_size=16)
    eot = tok.special_tokens[EOT]
    ids = [eot, *tok.encode_ordinary(TEXT * 6)]
    ids = ids[: 1 + 16 * ((len(ids) - 1) // 16)]  # a whole number of windows
    text = tok.decode(ids[1:])
    path = tmp_path / "long.txt.gz"
    path.write_bytes(gzip.compress(text.encode("utf-8")))
    assert tok.encode_ordinary(text) == ids[1:]
    result = bits_per_byte(Scorer(model, 4, progress=False), tok, path, eot)
    assert result.n_tokens == len(ids) - 1
    assert result.nats == pytest.approx(chunked_nats(model, ids, 16), rel=1e-5)
    finer = bits_per_byte(Scorer(model, 4, progress=False), tok, path, eot, stride=4)
    assert finer.n_tokens == result.n_tokens
    assert finer.bits_per_byte != pytest.approx(result.bits_per_byte, rel=1e-3)


def test_jsonl_documents_are_scored_separately(
    tmp_path: Path, tiny: Transformer, tok: Tokenizer
) -> None:
    docs = ["The cat sat.", "A dog ran home.", "Tom smiled."]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    eot = tok.special_tokens[EOT]
    result = bits_per_byte(Scorer(tiny, progress=False), tok, path, eot)
    nats = -sum(float(direct_logprobs(tiny, [eot, *tok.encode_ordinary(d)]).sum()) for d in docs)
    assert result.n_documents == 3
    assert result.nats == pytest.approx(nats, rel=1e-5)
    assert result.n_bytes == sum(len(d) for d in docs)


def test_without_end_of_text_the_first_token_and_its_bytes_are_left_out(
    tmp_path: Path, tiny: Transformer, tok: Tokenizer
) -> None:
    path = tmp_path / "fox.txt"
    path.write_text(TEXT, encoding="utf-8")
    ids = tok.encode_ordinary(TEXT)
    result = bits_per_byte(Scorer(tiny, progress=False), tok, path, None)
    assert result.n_tokens == len(ids) - 1
    assert result.n_bytes == len(TEXT.encode()) - len(tok.decode_bytes(ids[:1]))
    assert result.nats == pytest.approx(-float(direct_logprobs(tiny, ids).sum()), rel=1e-5)


def test_bits_per_byte_errors(tmp_path: Path, tiny: Transformer, tok: Tokenizer) -> None:
    scorer = Scorer(tiny, progress=False)
    with pytest.raises(KilnError, match=r"nope\.txt: no such file"):
        bits_per_byte(scorer, tok, tmp_path / "nope.txt", 399)
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe")
    with pytest.raises(KilnError, match=r"bad\.txt: invalid UTF-8 at byte 3"):
        bits_per_byte(scorer, tok, tmp_path / "bad.txt", 399)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(KilnError, match=r"empty\.txt: no text to score"):
        bits_per_byte(scorer, tok, tmp_path / "empty.txt", 399)


STORIES = ["Tom had a red ball.", "Lily saw a big dog. 🐶 It ran!", "The sun was warm."]
SEPARATED = "".join(f"{story}\n{EOT}\n" for story in STORIES)  # TinyStories' layout


def test_stream_bpb_of_a_uniform_model_is_log2_vocab_per_token(
    tmp_path: Path, tok: Tokenizer
) -> None:
    model = random_tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # all logits 0: every token costs ln V
    path = tmp_path / "valid.txt.gz"
    path.write_bytes(gzip.compress(SEPARATED.encode("utf-8")))
    result = stream_bits_per_byte(Scorer(model, progress=False), tok, path, 399)
    n_tokens = sum(len(tok.encode_ordinary(s)) + 1 for s in STORIES)  # each story + its EOT
    assert result.n_tokens == n_tokens
    assert result.n_bytes == len(SEPARATED.encode("utf-8"))  # separators and newlines too
    assert result.n_documents == 3
    expected = math.log2(model.cfg.vocab_size) * n_tokens / result.n_bytes
    assert result.bits_per_byte == pytest.approx(expected, rel=1e-6)


def test_stream_bpb_scores_the_documents_as_one_stream_in_windows(
    tmp_path: Path, tok: Tokenizer
) -> None:
    model = random_tiny(block_size=8)
    path = tmp_path / "stories.txt"
    path.write_text(SEPARATED * 3, encoding="utf-8")
    stream = [399]
    for story in STORIES * 3:
        stream += [*tok.encode_ordinary(story), 399]
    result = stream_bits_per_byte(Scorer(model, 4, progress=False), tok, path, 399)
    nats = 0.0  # disjoint chunks of 8 targets, the last window reaching back a full block
    for start in range(1, len(stream), 8):
        end = min(start + 8, len(stream))
        window = stream[max(0, end - 9) : end]
        nats -= float(direct_logprobs(model, window)[-(end - start) :].sum())
    assert result.n_tokens == len(stream) - 1
    assert result.nats == pytest.approx(nats, rel=1e-5)
    n_bytes = 3 * len(SEPARATED.encode("utf-8"))
    assert result.bits_per_byte == pytest.approx(nats / (math.log(2) * n_bytes), rel=1e-5)


def test_val_loss_is_the_mean_over_the_split_stream(dataset: Path) -> None:
    model = random_tiny(block_size=16)
    stream = Dataset.open(dataset).split("val").read(0, 33).astype(np.int64).tolist()
    result = val_loss(Scorer(model, 4, progress=False), dataset, max_tokens=33)
    assert result.n_tokens == 32
    assert result.loss == pytest.approx(chunked_nats(model, stream, 16) / 32, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.loss))
    whole = val_loss(Scorer(model, 4, progress=False), dataset)
    assert whole.n_tokens == Dataset.open(dataset).split("val").n_tokens - 1
    assert whole.n_documents == 6


def test_val_loss_errors(dataset: Path, tmp_path: Path) -> None:
    scorer = Scorer(random_tiny(block_size=16), progress=False)
    with pytest.raises(KilnError, match="no split 'test'"):
        val_loss(scorer, dataset, split="test")
    small = Scorer(random_tiny(vocab_size=300, block_size=16), progress=False)
    with pytest.raises(KilnError, match="400-token vocabulary, larger than the model's 300"):
        val_loss(small, dataset)
    with pytest.raises(KilnError, match="not a kiln token-shard dataset"):
        val_loss(scorer, tmp_path)


def test_scores_do_not_depend_on_the_stream_dtype(tiny: Transformer) -> None:
    ids = np.arange(1, 60, dtype=np.uint16)
    scorer = Scorer(tiny, progress=False)
    (a,) = scorer.score_documents([ids])
    (b,) = scorer.score_documents([ids.astype(np.int64).tolist()])
    assert a == b
    assert torch.is_inference_mode_enabled() is False  # scoring leaves the global mode alone


def test_val_loss_refuses_out_of_range_ids_when_verification_is_off(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kiln eval --val` on a shard corrupted after writing: one clear error, no IndexError."""
    import shutil

    from kiln.data.shard_format import HEADER_BYTES

    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    shard = copy / "val_000000.bin"
    data = bytearray(shard.read_bytes())
    data[HEADER_BYTES + 4 : HEADER_BYTES + 6] = np.array([65_535], np.uint16).tobytes()
    shard.write_bytes(data)
    monkeypatch.setenv("KILN_VERIFY_SHARDS", "0")
    scorer = Scorer(random_tiny(block_size=16), 4, progress=False)
    with pytest.raises(KilnError, match=r"val_000000\.bin: token 2 is id 65535, outside"):
        val_loss(scorer, copy)
