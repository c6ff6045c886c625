"""The quality classifier: trained from TOML sources it tells them apart on held-out documents,
training is reproducible to the byte, the threshold (or keep-fraction) decides removals with the
score recorded, and bad configuration is one line naming the field and the file."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from kiln.data.pipeline.config import load_pipeline_config
from kiln.data.pipeline.document import Document
from kiln.data.pipeline.filter.model_training import train_classifier
from kiln.data.pipeline.filter.quality_classifier import (
    ClassifierConfig,
    ClassifierFilter,
    LinearClassifier,
    features,
)
from kiln.errors import KilnError
from kiln.tokenizer.special import EOT


def read_docs(path: Path, chars: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        docs = [d.strip() for d in f.read(chars).split(EOT)]
    return [d for d in docs[:-1] if d]


def write_classifier_sources(shared_data: Path, folder: Path) -> Path:
    """Stories (positive) vs mixed web-like text (negative), a TOML naming them; its path."""
    stories = read_docs(shared_data / "tinystories" / "train.txt.gz", 400_000)[:300]
    web = read_docs(shared_data / "bench" / "en_10m.txt.gz", 900_000)[:300]
    (folder / "hq.txt").write_text("".join(f"{d}\n{EOT}\n" for d in stories), encoding="utf-8")
    (folder / "web.txt").write_text("".join(f"{d}\n{EOT}\n" for d in web), encoding="utf-8")
    config = folder / "cls.toml"
    config.write_text(
        'output = "cls.npz"\nbuckets = 65536\nheld_out = 0.4\n[[positive]]\nname = "stories"\n'
        'paths = ["hq.txt"]\n[[negative]]\nname = "web"\npaths = ["web.txt"]\n',
        encoding="utf-8",
    )
    return config


@pytest.fixture(scope="module")
def trained(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("cls")
    record = train_classifier(write_classifier_sources(shared_data, folder))
    return folder, record


def test_held_out_accuracy_is_recorded_and_high(trained):
    folder, record = trained
    held = record["held_out"]
    assert held["documents"] > 200
    assert held["accuracy"] >= 0.9
    assert record["positive_documents"] + record["negative_documents"] + held["documents"] == 600
    model = LinearClassifier.load(folder / "cls.npz")
    assert model.info["held_out"] == held


def test_training_is_reproducible_to_the_byte(trained, tmp_path):
    folder, _ = trained
    again = tmp_path / "again.npz"
    train_classifier(folder / "cls.toml", (f"output={again}",))
    assert again.read_bytes() == (folder / "cls.npz").read_bytes()


def test_features_are_hashed_word_ngrams():
    assert features("The cat", 1, 1000).size == 2
    assert features("The cat sat", 2, 1000).size == 3 + 2
    assert list(features("A b", 2, 97)) == list(features("a  B!", 2, 97))  # lowercased words


def stage(folder: Path, **overrides) -> ClassifierFilter:
    return ClassifierFilter(
        ClassifierConfig(enabled=True, model=str(folder / "cls.npz"), **overrides)
    )


def test_threshold_removes_low_scores_and_records_the_score(trained, shared_data):
    folder, _ = trained
    strict = stage(folder, threshold=0.5)
    story = read_docs(shared_data / "tinystories" / "valid.txt.gz", 20_000)[0]
    kept = Document("s", story, "t", {})
    assert strict.apply(kept) is None
    assert kept.meta["scores"]["classifier"] >= 0.5
    spam = Document(
        "w", "Buy cheap watches online, best price, click here, free shipping!", "t", {}
    )
    assert strict.apply(spam) == "classifier.low_score"
    assert 0.0 <= spam.meta["scores"]["classifier"] < 0.5
    assert stage(folder, threshold=0.0).apply(spam) is None  # the rule off: nothing removed


def test_keep_fraction_keeps_that_share_of_pipeline_like_input(trained, shared_data):
    folder, _ = trained
    web = read_docs(shared_data / "bench" / "en_10m.txt.gz", 2_500_000)[300:900]
    for fraction in (0.2, 0.5):
        s = stage(folder, keep_fraction=fraction)
        kept = np.mean([s.apply(Document("d", t, "t", {})) is None for t in web])
        assert abs(kept - fraction) < 0.1


def test_bad_configuration_is_one_clear_error(trained, tmp_path):
    folder, _ = trained
    p = tmp_path / "p.toml"
    head = '[[sources]]\nname = "a"\npaths = ["x"]\n[tokenize]\ntokenizer = "t.json"\n'
    for body, match in (
        ("threshold = 1.5", r"p\.toml: \[quality\.classifier\] threshold = 1\.5: expected"),
        ("keep_fraction = 0.0", r"p\.toml: \[quality\.classifier\] keep_fraction = 0\.0"),
        ("enabled = true\nthreshold = 0.5", r"quality\.classifier\] model: give"),
        ('enabled = true\nmodel = "m"', "give threshold or keep_fraction"),
    ):
        p.write_text(f"{head}[quality.classifier]\n{body}\n", encoding="utf-8")
        with pytest.raises(KilnError, match=match):
            load_pipeline_config(p)
    with pytest.raises(
        KilnError, match=r"quality\.classifier\.model = .*none/cls\.npz.*no such file"
    ):
        stage(tmp_path / "none", threshold=0.5)
    (folder / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(KilnError, match=r"negative: the sources \(web\) hold no documents"):
        train_classifier(folder / "cls.toml", ('negative=[{name="web",paths=["empty.txt"]}]',))


def test_cli_trains_and_prints_held_out_accuracy(trained, tmp_path, capsys):
    from kiln.cli import main

    folder, record = trained
    out = tmp_path / "cli.npz"
    assert (
        main(["data", "classifier", "train", str(folder / "cls.toml"), "--set", f"output={out}"])
        == 0
    )
    printed = capsys.readouterr().out
    assert f"held-out accuracy {record['held_out']['accuracy']:.1%}" in printed
    assert out.read_bytes() == (folder / "cls.npz").read_bytes()
    bad = ["data", "classifier", "train", str(folder / "cls.toml"), "--set", "held_out=1.5"]
    assert main(bad) == 2
    assert "cls.toml: held_out = 1.5: expected a fraction in (0, 1)" in capsys.readouterr().err
