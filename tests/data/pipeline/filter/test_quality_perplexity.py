"""CCNet perplexity buckets: the n-gram LM is a proper distribution, in-domain text scores lower
than out-of-domain text, documents land in head/middle/tail by the sample's percentiles, and
the buckets not kept are removed with their perplexity recorded."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from kiln.data.pipeline.config import load_pipeline_config
from kiln.data.pipeline.document import Document
from kiln.data.pipeline.filter.model_training import train_perplexity_lm
from kiln.data.pipeline.filter.quality_perplexity import (
    NGramLM,
    PerplexityConfig,
    PerplexityFilter,
    train_ngram,
)
from kiln.errors import KilnError
from kiln.tokenizer.special import EOT
from tests.data.pipeline.filter.test_quality_classifier import read_docs

TEXTS = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog", "the mat"]


@pytest.mark.parametrize("order", [1, 2, 3])
def test_probabilities_over_the_vocabulary_sum_to_one(order):
    lm = train_ngram(TEXTS, order=order)
    for history in ([1, 1], [1, lm.vocab["the"]], [lm.vocab["the"], lm.vocab["cat"]], [5, 7]):
        h = history[len(history) - (order - 1) :] if order > 1 else []
        total = sum(lm._prob(h, w) for w in range(len(lm.vocab)))
        assert total == pytest.approx(1.0, abs=1e-9)


def test_seen_text_is_more_likely_than_unseen_and_words_without_text_are_inf():
    lm = train_ngram(TEXTS, order=3)
    assert lm.perplexity("the cat sat on the mat") < lm.perplexity("mat the on sat cat the")
    assert lm.perplexity("the cat sat on the mat") < lm.perplexity("quantum flux capacitor")
    assert lm.perplexity("   \n ...") == math.inf


def test_save_and_load_keep_every_probability(tmp_path):
    lm = train_ngram(TEXTS, order=3)
    lm.info["sample_quantiles"] = [1.0, 2.0]
    lm.save(tmp_path / "lm.npz")
    back = NGramLM.load(tmp_path / "lm.npz")
    for text in [*TEXTS, "a mat and a log", "unseen words here"]:
        assert back.perplexity(text) == lm.perplexity(text)
    assert back.info == lm.info


@pytest.fixture(scope="module")
def lm_file(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lm")
    stories = read_docs(shared_data / "tinystories" / "train.txt.gz", 400_000)
    web = read_docs(shared_data / "bench" / "en_10m.txt.gz", 900_000)[:300]
    (folder / "ref.txt").write_text("".join(f"{d}\n{EOT}\n" for d in stories), encoding="utf-8")
    (folder / "web.txt").write_text("".join(f"{d}\n{EOT}\n" for d in web), encoding="utf-8")
    (folder / "lm.toml").write_text(
        'output = "lm.npz"\n[[reference]]\nname = "stories"\npaths = ["ref.txt"]\n'
        '[[sample]]\nname = "web"\npaths = ["web.txt"]\n',
        encoding="utf-8",
    )
    record = train_perplexity_lm(folder / "lm.toml")
    assert record["sample_documents"] == 300 and record["p30"] < record["p60"]
    return folder / "lm.npz"


def test_buckets_follow_the_sample_percentiles(lm_file, shared_data):
    stage = PerplexityFilter(PerplexityConfig(enabled=True, model=str(lm_file)))
    sample = read_docs(shared_data / "bench" / "en_10m.txt.gz", 900_000)[:300]
    buckets = [stage.bucket(stage.model.perplexity(t)) for t in sample]
    shares = {b: buckets.count(b) / len(buckets) for b in ("head", "middle", "tail")}
    assert shares["head"] == pytest.approx(0.3, abs=0.02)
    assert shares["middle"] == pytest.approx(0.3, abs=0.02)
    story = read_docs(shared_data / "tinystories" / "valid.txt.gz", 20_000)[0]
    assert stage.bucket(stage.model.perplexity(story)) == "head"  # in-domain: low perplexity


def test_unkept_buckets_are_removed_with_perplexity_and_bucket(lm_file, shared_data):
    web = read_docs(shared_data / "bench" / "en_10m.txt.gz", 2_500_000)[300:500]
    head_only = PerplexityFilter(PerplexityConfig(enabled=True, model=str(lm_file), keep=("head",)))
    every = PerplexityFilter(
        PerplexityConfig(enabled=True, model=str(lm_file), keep=("head", "middle", "tail"))
    )
    reasons = []
    for text in web:
        doc = Document("d", text, "t", {})
        reasons.append(head_only.apply(doc))
        assert doc.meta["perplexity_bucket"] in ("head", "middle", "tail")
        if reasons[-1] is not None:
            assert reasons[-1] == f"perplexity.{doc.meta['perplexity_bucket']}"
            assert doc.meta["scores"]["perplexity"] > head_only.head_cutoff
        assert every.apply(Document("d", text, "t", {})) is None  # the rule off
    assert 0.4 < np.mean([r is not None for r in reasons]) < 0.95


def test_bad_configuration_is_one_clear_error(tmp_path):
    p = tmp_path / "p.toml"
    head = '[[sources]]\nname = "a"\npaths = ["x"]\n[tokenize]\ntokenizer = "t.json"\n'
    for body, match in (
        ("percentile_head = 70", r"p\.toml: \[quality\.perplexity\] percentile_head = 70"),
        ('keep = ["top"]', r"p\.toml: \[quality\.perplexity\] keep = \['top'\]: expected"),
        ("enabled = true", r"\[quality\.perplexity\] model: give"),
    ):
        p.write_text(f"{head}[quality.perplexity]\n{body}\n", encoding="utf-8")
        with pytest.raises(KilnError, match=match):
            load_pipeline_config(p)
    with pytest.raises(KilnError, match=r"quality\.perplexity\.model = .*lm\.npz.*no such file"):
        PerplexityFilter(PerplexityConfig(enabled=True, model=str(tmp_path / "lm.npz")))
    (tmp_path / "lm.toml").write_text(
        '[[reference]]\nname = "r"\npaths = ["missing*.txt"]\n[[sample]]\nname = "s"\n'
        'paths = ["x"]\n',
        encoding="utf-8",
    )
    with pytest.raises(KilnError, match=r"reference\['r'\]: missing\*\.txt matches no file"):
        train_perplexity_lm(tmp_path / "lm.toml")


def test_cli_trains_and_prints_the_cutoffs(lm_file, capsys):
    from kiln.cli import main

    toml = lm_file.parent / "lm.toml"
    out = lm_file.parent / "cli.npz"
    assert main(["data", "perplexity", "train", str(toml), "--set", f"output={out}"]) == 0
    assert "30th percentile perplexity" in capsys.readouterr().out
    assert NGramLM.load(out).info == NGramLM.load(lm_file).info
