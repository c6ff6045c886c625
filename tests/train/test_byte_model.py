"""Byte-level models: the byte tokenizer round-trips any text, makes shards from the same
command and pipeline TOML as BPE, trains with the same Trainer and is scored by the same bpb."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.data.pipeline.config import load_pipeline_config
from kiln.data.pipeline.runner import RunOptions, run_pipeline
from kiln.data.shard_reader import Dataset
from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
from kiln.eval.lm import stream_bits_per_byte
from kiln.eval.scoring import Scorer
from kiln.loading import load_model
from kiln.model import ModelConfig
from kiln.model.transformer import Transformer
from kiln.tokenizer import Tokenizer
from kiln.tokenizer.formats import read_any
from kiln.tokenizer.special import EOT
from kiln.train.trainer import Trainer
from tests.fixtures import require_shared
from tests.train.conftest import CONFIGS, SHARED_DATA

TEXTS = ["Once upon a time", "héllo wörld — ünïcode", "🦊🦊 emoji and \t tabs\n\nnewlines", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_and_ids_are_the_bytes(text: str) -> None:
    tok = Tokenizer.raw_bytes()
    ids = tok.encode_ordinary(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.n_vocab == 257 and tok.special_tokens == {EOT: 256} and not tok.merges
    assert tok.encode(f"{text}{EOT}", allowed_special="all")[-1] == 256


def test_byte_tokenizer_saves_and_loads_as_a_kiln_tokenizer(tmp_path: Path) -> None:
    Tokenizer.raw_bytes().save(tmp_path / "tok.json")
    tok = read_any(tmp_path / "tok.json")
    assert tok.encode_ordinary("ab€") == [97, 98, 0xE2, 0x82, 0xAC]
    assert tok.metadata["kind"] == "bytes"


@pytest.fixture(scope="module")
def stories(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first ~20 KB of TinyStories' valid file, whole stories."""
    source = require_shared(SHARED_DATA / "tinystories" / "valid.txt.gz")
    with gzip.open(source, "rt", encoding="utf-8") as handle:
        text = handle.read(20_000)
    path = tmp_path_factory.mktemp("bytes") / "stories.txt"
    path.write_text(text[: text.rfind(EOT) + len(EOT)], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def byte_shards(stories: Path) -> Path:
    """`stories` as byte shards, by `tokenize_to_shards` with tokenizer = "bytes"."""
    out = stories.parent / "shards"
    tokenize_to_shards(
        TokenizeConfig(tokenizer="bytes", inputs=(str(stories),), out=str(out), val_docs=2,
                       workers=1, progress=False)
    )  # fmt: skip
    return out


def test_byte_shards_hold_the_utf8_bytes_of_each_document(byte_shards: Path, stories: Path) -> None:
    ds = Dataset.open(byte_shards)
    assert ds.manifest.tokenizer.vocab_size == 257 and ds.eot_id == 256
    assert ds.manifest.dtype == "uint16"
    tok_file = ds.manifest.tokenizer.locate(byte_shards)
    assert tok_file == byte_shards / "tokenizer.json"  # the dataset carries its tokenizer
    docs = [d.strip() for d in stories.read_text(encoding="utf-8").split(EOT) if d.strip()]
    train, val = ds.split("train"), ds.split("val")
    assert train.n_documents + val.n_documents == len(docs)
    tokens = np.concatenate([train.read(0, train.n_tokens), val.read(0, val.n_tokens)])
    assert tokens.size == sum(len(d.encode("utf-8")) + 1 for d in docs)
    assert int((tokens == 256).sum()) == len(docs) and tokens.max() == 256


def test_the_pipeline_toml_takes_tokenizer_bytes(stories: Path, tmp_path: Path) -> None:
    (tmp_path / "stories.txt").write_text(stories.read_text(encoding="utf-8"), encoding="utf-8")
    config = tmp_path / "p.toml"
    config.write_text(
        'docs_per_task = 4\n[[sources]]\nname = "stories"\npaths = ["stories.txt"]\n'
        '[tokenize]\ntokenizer = "bytes"\n',
        encoding="utf-8",
    )
    cfg = load_pipeline_config(config)
    assert cfg.tokenize.tokenizer == "bytes"  # a name, not a path beside the TOML
    manifest = run_pipeline(cfg, RunOptions(out=str(tmp_path / "out"), progress=False))
    assert manifest.tokenizer.vocab_size == 257
    ds = Dataset.open(tmp_path / "out")
    assert ds.manifest.tokenizer.locate(tmp_path / "out") == tmp_path / "out" / "tokenizer.json"


def test_a_byte_model_trains_with_the_trainer_and_loads_with_its_tokenizer(
    byte_shards: Path, stories: Path, tmp_path: Path
) -> None:
    from kiln.train.config import load_train_config

    cfg = load_train_config(
        CONFIGS / "tiny.toml",
        [f"data.dataset={byte_shards}", f"logging.run_dir={tmp_path / 'run'}",
         "logging.progress=false", "train.max_steps=12", "eval.every=0", "checkpoint.every=12"],
    )  # fmt: skip
    trainer = Trainer(cfg, tmp_path / "run")
    result = trainer.run()
    assert trainer.model.cfg.vocab_size == 257
    assert result.losses[-1] < result.losses[0] < math.log(257) + 0.5
    loaded = load_model(tmp_path / "run", dtype="fp32")
    assert loaded.tokenizer is not None and loaded.tokenizer.n_vocab == 257
    scored = stream_bits_per_byte(Scorer(loaded.model, progress=False), loaded.tokenizer, stories,
                                  loaded.tokenizer.special_tokens[EOT])  # fmt: skip
    assert scored.bits_per_byte is not None and scored.bits_per_byte < math.log2(257)


def _uniform(vocab: int) -> Transformer:
    model = Transformer(ModelConfig.preset("tiny", vocab_size=vocab, tie_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # logits 0: the uniform distribution over the vocabulary
    return model.eval()


def test_bits_per_byte_has_the_same_definition_for_bytes_and_bpe(stories: Path) -> None:
    # Under the uniform distribution bpb = scored tokens · log2(V) / file bytes, whatever the
    # tokenizer; for bytes the scored tokens are every UTF-8 byte of the documents plus one
    # end-of-text per document.
    bpe = read_any(require_shared(SHARED_DATA / "gpt2" / "vocab.json"))
    data = stories.read_bytes()
    docs = [d.strip() for d in data.decode("utf-8").split(EOT) if d.strip()]
    for tok, vocab in ((Tokenizer.raw_bytes(), 257), (bpe, bpe.n_vocab)):
        eot = tok.special_tokens[EOT]
        res = stream_bits_per_byte(Scorer(_uniform(vocab), progress=False), tok, stories, eot)
        assert res.n_bytes == len(data)
        assert res.bits_per_byte == pytest.approx(res.n_tokens * math.log2(vocab) / len(data))
        if vocab == 257:
            assert res.n_tokens == sum(len(d.encode("utf-8")) for d in docs) + len(docs)
