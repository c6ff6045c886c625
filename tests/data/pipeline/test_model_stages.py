"""The URL blocklist, bad-words, classifier and perplexity stages in a `kiln data run`: each
removal is in the audit log with its stage, reason and score (or evidence), the report shows the
classifier's held-out accuracy, and 1 worker, 2 workers and Ray give byte-identical output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiln.data.pipeline.config import load_pipeline_config
from kiln.data.pipeline.filter.model_training import train_classifier, train_perplexity_lm
from kiln.data.pipeline.records import read_records
from kiln.data.pipeline.runner import RunOptions, run_pipeline
from tests.data.pipeline.filter.test_quality_classifier import read_docs, write_classifier_sources
from tests.data.pipeline.test_runner import output_fingerprint


@pytest.fixture(scope="module")
def setup(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    train_classifier(write_classifier_sources(shared_data, root))
    (root / "lm.toml").write_text(
        'output = "lm.npz"\n[[reference]]\nname = "stories"\npaths = ["hq.txt"]\n'
        '[[sample]]\nname = "web"\npaths = ["web.txt"]\n',
        encoding="utf-8",
    )
    train_perplexity_lm(root / "lm.toml")
    stories = read_docs(shared_data / "tinystories" / "valid.txt.gz", 60_000)[:30]
    web = read_docs(shared_data / "bench" / "en_10m.txt.gz", 2_000_000)[300:340]
    records = [{"text": t, "url": f"https://stories.example/{i}"} for i, t in enumerate(stories)]
    records += [{"text": t, "url": f"https://web.example/{i}"} for i, t in enumerate(web)]
    records[3]["url"] = "https://www.blocked.example/page"  # a story from a blocked domain
    records[4]["text"] += "\nThe old man said it was all bullshit and walked away."
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    (root / "block.txt").write_text("blocked.example\n", encoding="utf-8")
    (root / "p.toml").write_text(
        f"""
docs_per_task = 9
[[sources]]
name = "mixed"
paths = ["in.jsonl"]
[url_blocklist]
enabled = true
file = "block.txt"
[bad_words]
enabled = true
[quality.classifier]
enabled = true
model = "cls.npz"
threshold = 0.42
[quality.perplexity]
enabled = true
model = "lm.npz"
keep = ["head"]
[split]
val_fraction = 0.0
[tokenize]
tokenizer = "{shared_data}/gpt2/vocab.json"
""",
        encoding="utf-8",
    )
    return root


def _run(root: Path, out: Path, **options: Any) -> Path:
    run_pipeline(
        load_pipeline_config(root / "p.toml"), RunOptions(out=str(out), progress=False, **options)
    )
    return out


@pytest.fixture(scope="module")
def one_worker(setup: Path) -> Path:
    return _run(setup, setup / "one", workers=1)


def test_every_new_stage_removes_with_stage_reason_and_score(one_worker: Path) -> None:
    removed = list(read_records(one_worker / "pipeline" / "removed.jsonl.zst"))
    by_stage: dict[str, list[dict[str, Any]]] = {}
    for r in removed:
        by_stage.setdefault(r["stage"], []).append(r)
    blocked = by_stage["url_blocklist"]
    assert [(r["ordinal"], r["reason"], r["blocked_by"]) for r in blocked] == [
        (3, "url_blocklist.domain", "blocked.example")
    ]
    assert any(r["ordinal"] == 4 and r["bad_word"] == "bullshit" for r in by_stage["bad_words"])
    assert all(r["score"] >= 1 for r in by_stage["bad_words"])
    low = by_stage["classifier"]
    assert low and all(r["reason"] == "classifier.low_score" and r["score"] < 0.42 for r in low)
    assert all(r["ordinal"] >= 30 for r in low)  # only web documents score low
    tail = by_stage["perplexity"]
    assert tail and all(r["reason"] == f"perplexity.{r['perplexity_bucket']}" for r in tail)
    assert all(r["perplexity_bucket"] != "head" and r["score"] > 0 for r in tail)
    stats = json.loads((one_worker / "pipeline" / "stats.json").read_text())
    assert stats["models"]["classifier"]["held_out"]["accuracy"] >= 0.9
    page = (one_worker / "pipeline" / "report.html").read_text()
    assert "held-out accuracy" in page and "removed-classifier-classifier.low_score" in page


def test_two_workers_give_byte_identical_output(setup: Path, one_worker: Path) -> None:
    two = _run(setup, setup / "two", workers=2)
    assert output_fingerprint(two) == output_fingerprint(one_worker)


def test_ray_gives_byte_identical_output(setup: Path, one_worker: Path) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        out = _run(setup, setup / "ray", workers=2, executor="ray")
    finally:
        ray.shutdown()
    assert output_fingerprint(out) == output_fingerprint(one_worker)


def test_a_replaced_model_file_counts_as_a_changed_config(setup: Path, one_worker: Path) -> None:
    from kiln.data.pipeline.runner import run_digest

    cfg = load_pipeline_config(setup / "p.toml")
    before = run_digest(cfg)
    original = (setup / "block.txt").read_text()
    try:
        (setup / "block.txt").write_text(original + "other.example\n")
        assert run_digest(cfg) != before
    finally:
        (setup / "block.txt").write_text(original)
