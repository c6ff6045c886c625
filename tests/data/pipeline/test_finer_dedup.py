"""Line dedup, Jaccard-verified near dedup and Bloom exact dedup in a `kiln data run`: each
removal is audited, each rule's effect disappears when it is switched off, and 1 worker,
2 workers and Ray give byte-identical output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiln.data.pipeline.config import load_pipeline_config
from kiln.data.pipeline.dedup.minhash import hash_word_ngrams
from kiln.data.pipeline.dedup.verify import distinct_shingles, jaccard
from kiln.data.pipeline.records import read_records
from kiln.data.pipeline.runner import RunOptions, run_pipeline
from kiln.errors import KilnError
from tests.data.pipeline.test_runner import _stories, output_fingerprint

BOILERPLATE = "Subscribe to our newsletter for a new story every week!"
FOOTER = "Copyright Story Corner. All rights reserved."


def _mutate(text: str, every: int) -> str:
    words = text.split(" ")
    return " ".join(("quietly" if i % every == 7 else w) for i, w in enumerate(words))


def shingle_jaccard(a: str, b: str, ngram: int = 5) -> float:
    """Exact Jaccard of two texts' MinHash shingle sets."""
    values, offsets = distinct_shingles(*hash_word_ngrams([a, b], ngram))
    return jaccard(values[offsets[0] : offsets[1]], values[offsets[1] : offsets[2]])


@pytest.fixture(scope="module")
def corpus(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("finer")
    stories = _stories(shared_data, 30)
    docs = list(stories[:24])
    for i in range(0, 12, 2):  # 0, 2, ..., 10: boilerplate in six documents
        docs[i] = f"{docs[i]}\n{BOILERPLATE}\n{FOOTER}"
    docs.append(f"{BOILERPLATE}\n{FOOTER}")  # 24: nothing but boilerplate
    docs.append(_mutate(stories[15], 100))  # 25: a near duplicate of 15 (Jaccard ~0.9)
    docs.append(_mutate(stories[17], 14))  # 26: a weak look-alike of 17 (Jaccard ~0.5)
    docs.append(stories[19])  # 27: an exact duplicate of 19
    (root / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), "utf-8")
    (root / "p.toml").write_text(
        f"""
docs_per_task = 7
[[sources]]
name = "stories"
paths = ["in.jsonl"]
[quality.gopher_quality]
enabled = false
[quality.gopher_repetition]
enabled = false
[quality.c4]
enabled = false
[quality.fineweb]
enabled = false
[dedup.exact]
method = "bloom"
false_positive_rate = 0.001
[dedup.near]
bands = 20
rows = 3
jaccard_threshold = 0.75
[dedup.lines]
enabled = true
min_documents = 3
[split]
val_fraction = 0.0
[tokenize]
tokenizer = "{shared_data}/gpt2/vocab.json"
""",
        encoding="utf-8",
    )
    return {"root": root, "docs": docs, "stories": stories}


def _run(corpus: dict[str, Any], out: Path, *overrides: str, **options: Any) -> Path:
    cfg = load_pipeline_config(corpus["root"] / "p.toml", overrides)
    run_pipeline(cfg, RunOptions(out=str(out), progress=False, **options))
    return out


def _removed(out: Path) -> dict[int, dict[str, Any]]:
    return {r["ordinal"]: r for r in read_records(out / "pipeline" / "removed.jsonl.zst")}


def _output(out: Path) -> dict[int, dict[str, Any]]:
    records = [r for p in sorted(out.glob("train_*.docs.jsonl.zst")) for r in read_records(p)]
    return {r["ordinal"]: r for r in records}


def _stats(out: Path) -> dict[str, Any]:
    return json.loads((out / "pipeline" / "stats.json").read_text())


def _funnel(out: Path, stage: str) -> dict[str, Any]:
    return next(row for row in _stats(out)["funnel"] if row["stage"] == stage)


@pytest.fixture(scope="module")
def one_worker(corpus: dict[str, Any]) -> Path:
    return _run(corpus, corpus["root"] / "one", workers=1)


def test_planted_pairs_have_the_intended_jaccard(corpus: dict[str, Any]) -> None:
    docs = corpus["docs"]
    assert shingle_jaccard(docs[25], docs[15]) > 0.85
    assert 0.4 < shingle_jaccard(docs[26], docs[17]) < 0.6


def test_lines_in_many_documents_are_removed_and_the_documents_kept(one_worker: Path) -> None:
    out = _output(one_worker)
    for i in range(0, 12, 2):
        assert i in out
        entry = next(h for h in out[i]["history"] if h["stage"] == "line_dedup")
        assert entry["units_removed"] == 2 and entry["chars_after"] < entry["chars_before"]
    assert not any(h["stage"] == "line_dedup" for h in out[1]["history"])
    removed = _removed(one_worker)
    assert removed[24]["stage"] == "line_dedup"
    assert removed[24]["reason"] == "line_dedup.empty" and removed[24]["units_removed"] == 2
    row = _funnel(one_worker, "line_dedup")
    assert row["changed"] == 6 and row["removed"] == {"line_dedup.empty": 1}
    assert row["details"]["frequent_units"] == 2 and row["details"]["units_removed"] == 14


def test_the_written_tokens_lack_the_removed_lines(shared_data: Path, one_worker: Path) -> None:
    from kiln.data.pipeline.mix.writer import DOC_MAP_SUFFIX
    from kiln.data.shard_reader import Dataset
    from kiln.tokenizer.formats import read_any

    tok = read_any(shared_data / "gpt2" / "vocab.json")
    split = Dataset.open(one_worker).split("train")
    maps = [r for p in sorted(one_worker.glob(f"train_*{DOC_MAP_SUFFIX}")) for r in read_records(p)]
    texts = {m["ordinal"]: tok.decode(split.document(i)[:-1].tolist()) for i, m in enumerate(maps)}
    assert texts[0] and BOILERPLATE not in texts[0] and FOOTER not in texts[0]
    assert all(BOILERPLATE not in t for t in texts.values())


def test_bloom_exact_dedup_removes_the_copy_and_reports_its_rate(one_worker: Path) -> None:
    removed = _removed(one_worker)
    assert removed[27]["stage"] == "exact_dedup"
    assert removed[27]["reason"] == "exact_dedup.bloom_seen"
    details = _funnel(one_worker, "exact_dedup")["details"]
    assert details["method"] == "bloom" and details["false_positive_rate"] == 0.001
    assert details["keys"] == 28 and details["removed"] == 1
    # With every key in, about half the bits are set and the rate is near the design rate.
    assert 0.0002 < details["false_positive_rate_at_end"] < 0.005
    assert 0.4 < details["fill"] < 0.6
    assert details["probes"] == 10 and details["bits"] >= 28 * 14


def test_verification_keeps_the_weak_look_alike_and_removes_the_near_duplicate(
    corpus: dict[str, Any], one_worker: Path
) -> None:
    removed = _removed(one_worker)
    assert removed[25]["stage"] == "near_dedup"
    assert 26 not in removed
    details = _funnel(one_worker, "near_dedup")["details"]
    assert (
        details["jaccard_threshold"] == 0.75 and details["verified"] < details["candidate_checks"]
    )
    # Without verification, LSH at 20 bands x 3 rows merges the look-alike too.
    off = _run(corpus, corpus["root"] / "noverify", "dedup.near.jaccard_threshold=0")
    assert _removed(off)[26]["stage"] == "near_dedup"
    assert "details" not in _funnel(off, "near_dedup")


def test_switched_off_every_rule_leaves_its_documents_alone(corpus: dict[str, Any]) -> None:
    out = _run(
        corpus,
        corpus["root"] / "off",
        "dedup.lines.enabled=false",
        "dedup.exact.method=sort",
    )
    docs = _output(out)
    assert not any(h["stage"] == "line_dedup" for h in docs[0]["history"])
    removed = _removed(out)
    assert 24 not in removed
    assert removed[27]["reason"] == "exact_dedup.duplicate"  # the sort method names the copy
    assert all(row["stage"] != "line_dedup" for row in _stats(out)["funnel"])


def test_two_workers_give_byte_identical_output(corpus: dict[str, Any], one_worker: Path) -> None:
    two = _run(corpus, corpus["root"] / "two", workers=2, partitions=3)
    assert output_fingerprint(two) == output_fingerprint(one_worker)


def test_ray_gives_byte_identical_output(corpus: dict[str, Any], one_worker: Path) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        out = _run(corpus, corpus["root"] / "ray", workers=2, executor="ray")
    finally:
        ray.shutdown()
    assert output_fingerprint(out) == output_fingerprint(one_worker)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("dedup.lines.min_documents=1", "dedup.lines.min_documents"),
        ("dedup.lines.unit=sentence", "dedup.lines.unit"),
        ("dedup.near.jaccard_threshold=1.5", "dedup.near.jaccard_threshold"),
        ("dedup.exact.false_positive_rate=0", "dedup.exact.false_positive_rate"),
        ("dedup.exact.method=cuckoo", "dedup.exact.method"),
    ],
)
def test_bad_settings_name_the_field_and_the_file(
    corpus: dict[str, Any], override: str, field: str
) -> None:
    with pytest.raises(KilnError) as info:
        load_pipeline_config(corpus["root"] / "p.toml", (override,))
    message = str(info.value)
    assert field in message and "p.toml" in message and "\n" not in message
