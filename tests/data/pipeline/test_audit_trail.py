"""The audit trail on a planted corpus: every duplicate, near duplicate and benchmark passage
planted in real documents is traceable from the kept document's history in the shard's
document map, from `removed.jsonl.zst`, and from `kiln data inspect --token/--doc`."""

from __future__ import annotations

import bz2
import gzip
import html
import json
from pathlib import Path
from typing import Any

import pytest

from kiln.data.pipeline.config import load_pipeline_config
from kiln.data.pipeline.filter.normalise import Normalise, NormaliseConfig
from kiln.data.pipeline.records import read_records
from kiln.data.pipeline.runner import RunOptions, run_pipeline
from kiln.data.shard_reader import Dataset
from kiln.tokenizer.formats import read_any

EOT = "<|endoftext|>"
N_REAL = 40


def hellaswag_item(shared_data: Path, item: int) -> str:
    """HellaSwag validation item `item` (0-based) as pasted text: context and gold ending."""
    with bz2.open(shared_data / "eval" / "hellaswag_val.txt.bz2", "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()[6 * item : 6 * item + 6]
    context = lines[0].split(": ", 1)[1]
    return f"{context} {lines[2 + int(lines[1])].strip()}"


def real_documents(shared_data: Path, n: int) -> list[str]:
    """n real English documents of about 3,000 characters (cut at a space)."""
    with gzip.open(shared_data / "bench" / "en_10m.txt.gz", "rt", encoding="utf-8") as f:
        docs = f.read(3_000_000).split(f"\n{EOT}\n")
    long = [d for d in docs if len(d) >= 3200][:n]
    return [d[: d.rfind(" ", 0, 3000)] for d in long]


def edit_words(text: str, fraction: float) -> str:
    """`text` with `fraction` of its words replaced, in three runs (a ~3%-edited copy)."""
    words = text.split(" ")
    run = max(1, int(len(words) * fraction / 3))
    for start in (len(words) // 5, len(words) // 2, 4 * len(words) // 5):
        words[start : start + run] = ["edited"] * run
    return " ".join(words)


@pytest.fixture(scope="module")
def planted(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the pipeline on real documents plus planted copies, edits and passages."""
    root = tmp_path_factory.mktemp("planted")
    docs = real_documents(shared_data, N_REAL)
    plan: dict[str, Any] = {"exact": {}, "near": {}, "chain": {}, "passage": {}, "cut_copy": {}}

    def add(text: str) -> int:
        docs.append(text)
        return len(docs) - 1

    for k in (1, 2):  # exact copies: spacing and case differ, the exact key does not
        plan["exact"][k] = add(docs[k].replace(" ", "  ").upper())
    for k in (3, 4, 5):
        plan["near"][k] = add(edit_words(docs[k], 0.03))
    # A copy of the near copy of 3: exact dedup matches it to the near copy, which near dedup
    # merges into 3, so the log must name 3 (the document finally kept).
    plan["chain"][3] = add(docs[plan["near"][3]] + "  ")
    for k, item in ((6, 10), (7, 20), (8, 30)):  # benchmark passages pasted mid-document
        middle = docs[k].find(" ", len(docs[k]) // 2)
        passage = hellaswag_item(shared_data, item)
        docs[k] = f"{docs[k][:middle]}\n{passage}\n{docs[k][middle + 1 :]}"
        plan["passage"][k] = (item, passage)
    # A copy of 9 with five benchmark passages pasted at its end: once they are cut out (with
    # the window before them) it is a prefix of 9, and near dedup, on fingerprints taken after
    # the cuts, finds it; on the text as read, the passages make it too different.
    docs[9] = docs[9][: docs[9].rfind(" ", 0, 1500)]
    passages = "\n".join(hellaswag_item(shared_data, item) for item in range(40, 45))
    plan["cut_copy"][9] = add(f"{docs[9]}\n{passages}")
    (root / "planted.txt").write_text("".join(f"{d}\n{EOT}\n" for d in docs), encoding="utf-8")
    (root / "p.toml").write_text(
        f"""
docs_per_task = 10
[[sources]]
name = "web"
paths = ["planted.txt"]
[quality.gopher_quality]
enabled = false
[quality.gopher_repetition]
enabled = false
[quality.c4]
enabled = false
[quality.fineweb]
enabled = false
[decontaminate]
eval_files = ["{shared_data}/eval/hellaswag_val.txt.bz2"]
[split]
val_fraction = 0.0
[tokenize]
tokenizer = "{shared_data}/gpt2/vocab.json"
shard_tokens = 20000
""",
        encoding="utf-8",
    )
    out = root / "out"
    run_pipeline(load_pipeline_config(root / "p.toml"), RunOptions(out=str(out), progress=False))
    maps = {}
    for path in sorted(out.glob("train_*.docs.jsonl.zst")):
        for record in read_records(path):
            maps[record["id"]] = record
    removed = {r["id"]: r for r in read_records(out / "pipeline" / "removed.jsonl.zst")}
    return {"out": out, "docs": docs, "plan": plan, "maps": maps, "removed": removed}


def doc_id(k: int) -> str:
    return f"web:planted.txt:{k}"


def merged(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["id"]: d for d in record["duplicates"]}


def test_every_planted_copy_is_in_its_kept_documents_cluster(planted: dict[str, Any]) -> None:
    maps, removed, plan = planted["maps"], planted["removed"], planted["plan"]
    for kind, stage in (("exact", "exact_dedup"), ("near", "near_dedup")):
        for kept, copy in plan[kind].items():
            assert doc_id(copy) not in maps
            dup = merged(maps[doc_id(kept)])[doc_id(copy)]
            assert dup["stage"] == stage and dup["ordinal"] == copy
            assert removed[doc_id(copy)]["duplicate_of"] == doc_id(kept)
    # The chain: the record names the document finally kept, and what it actually matched.
    chain = doc_id(plan["chain"][3])
    assert removed[chain]["stage"] == "exact_dedup"
    assert removed[chain]["duplicate_of"] == doc_id(3)
    assert removed[chain]["matched"] == doc_id(plan["near"][3])
    assert set(merged(maps[doc_id(3)])) == {doc_id(plan["near"][3]), chain}
    # Every kept document with no planted copy has an empty cluster.
    planted_kept = {doc_id(k) for kind in ("exact", "near", "cut_copy") for k in plan[kind]}
    assert all(not r["duplicates"] for i, r in maps.items() if i not in planted_kept)


def test_every_planted_passage_is_a_recorded_cut(
    planted: dict[str, Any], shared_data: Path
) -> None:
    maps, out = planted["maps"], planted["out"]
    ds = Dataset.open(out)
    tok = read_any(shared_data / "gpt2" / "vocab.json")
    train_ids = [
        r["id"] for p in sorted(out.glob("train_*.docs.jsonl.zst")) for r in read_records(p)
    ]
    for k, (item, passage) in planted["plan"]["passage"].items():
        record = maps[doc_id(k)]
        (change,) = [h for h in record["history"] if h["stage"] == "decontaminate"]
        (cut,) = change["decontam_cuts"]
        assert item in cut["matched"]["hellaswag"]
        assert cut["chars"] >= len(passage) + 400 and cut["words"] >= len(passage.split())
        assert change["chars_after"] < change["chars_before"] - len(passage)
        text = tok.decode(ds.split("train").document(train_ids.index(doc_id(k)))[:-1].tolist())
        assert passage[:60] not in text and len(text) == change["chars_after"]
        # The cut is at word boundaries: every word left is a word of the document as read
        # (after normalisation, the stage before).
        read = Normalise(NormaliseConfig()).normalise(planted["docs"][k])
        assert set(text.split()) <= set(read.split())
    # Nothing else was cut.
    cut_ids = {
        i for i, r in maps.items() if any(h["stage"] == "decontaminate" for h in r["history"])
    }
    assert cut_ids == {doc_id(k) for k in planted["plan"]["passage"]}


def test_a_cut_copy_that_became_a_prefix_is_caught_by_near_dedup(planted: dict[str, Any]) -> None:
    (copy,) = planted["plan"]["cut_copy"].values()
    record = planted["removed"][doc_id(copy)]
    assert (record["stage"], record["duplicate_of"]) == ("near_dedup", doc_id(9))
    assert doc_id(copy) in merged(planted["maps"][doc_id(9)])


def _first_token_of(out: Path, wanted: str) -> int:
    ds = Dataset.open(out)
    train = ds.split("train")
    ids = [r["id"] for p in sorted(out.glob("train_*.docs.jsonl.zst")) for r in read_records(p)]
    return int(train.document_start(ids.index(wanted))) + 2


def test_inspect_token_and_doc_print_the_history(
    planted: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from kiln.cli import main

    out, plan = str(planted["out"]), planted["plan"]
    assert (
        main(["data", "inspect", out, "--token", str(_first_token_of(planted["out"], doc_id(3)))])
        == 0
    )
    printed = capsys.readouterr().out
    history, _, nearby = printed.partition("nearby removals in the input")
    assert f"id {doc_id(3)}" in history and "record 3" in history
    assert "duplicates merged into it (2)" in history
    assert f"{doc_id(plan['near'][3])} (input " in history and "near_dedup.duplicate" in history
    assert f"{doc_id(plan['chain'][3])} (input " in history
    assert f"matched {doc_id(plan['near'][3])}" in history
    assert nearby  # labelled apart from the history
    ids = [
        r["id"]
        for p in sorted(planted["out"].glob("train_*.docs.jsonl.zst"))
        for r in read_records(p)
    ]
    assert main(["data", "inspect", out, "--doc", str(ids.index(doc_id(3)))]) == 0
    assert f"{doc_id(plan['chain'][3])} (input " in capsys.readouterr().out  # by index too
    for k, (item, _) in plan["passage"].items():
        assert main(["data", "inspect", out, "--doc", doc_id(k), "--max-chars", "50"]) == 0
        printed = capsys.readouterr().out
        assert "decontaminate: cut passages matching evaluation sets" in printed
        assert "hellaswag item" in printed and str(item) in printed
        assert "normalise" in printed or "changes:" in printed


def test_report_links_funnel_numbers_to_sample_documents(planted: dict[str, Any]) -> None:
    page = (planted["out"] / "pipeline" / "report.html").read_text()
    for anchor in ("removed-exact_dedup-exact_dedup.duplicate", "kept", "changed-decontaminate"):
        assert f'href="#{anchor}"' in page and f"id='{anchor}'" in page
    assert html.escape(doc_id(6)) in page  # a cut document is among the examples
    stats = json.loads((planted["out"] / "pipeline" / "stats.json").read_text())
    decontam = next(r for r in stats["funnel"] if r["stage"] == "decontaminate")
    assert decontam["changed"] == len(planted["plan"]["passage"])
