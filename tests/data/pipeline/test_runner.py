"""`kiln data run` end to end: planted problems are caught and audited, and the output is the
same for any worker count, either executor, and after a kill and resume."""

from __future__ import annotations

import gzip
import itertools
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.data.manifest import Manifest
from kiln.data.pipeline import tasks as task_module
from kiln.data.pipeline.config import load_pipeline_config
from kiln.data.pipeline.records import read_records
from kiln.data.pipeline.runner import RunOptions, run_pipeline
from kiln.data.shard_reader import Dataset
from kiln.errors import KilnError
from kiln.tokenizer.formats import read_any
from tests.data.pipeline.conftest import write_stories_pipeline

EOT = "<|endoftext|>"


def _stories(shared: Path, n: int) -> list[str]:
    with gzip.open(shared / "tinystories" / "valid.txt.gz", "rt", encoding="utf-8") as handle:
        text = handle.read(400_000)
    stories = [s.strip() for s in text.split(EOT) if len(s.split()) > 120]
    assert len(stories) >= n
    return stories[:n]


def _mutate(text: str, every: int) -> str:
    words = text.split(" ")
    return " ".join(("quietly" if i % every == 7 else w) for i, w in enumerate(words))


@pytest.fixture(scope="module")
def corpus(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two sources with planted duplicates, a benchmark passage, junk and malformed records."""
    root = tmp_path_factory.mktemp("pipeline_corpus")
    stories = _stories(shared_data, 44)
    lambada = json.loads((shared_data / "eval" / "lambada_openai.jsonl").open().readline())
    passage = f"{lambada['context']} {lambada['continuation']}"
    docs_a = list(stories[:30])
    docs_a.append(stories[3].replace(" ", "  ") + "\n")  # 30: exact duplicate of 3 (spacing)
    docs_a.append(_mutate(stories[5], 40))  # 31: near duplicate of 5
    # 7: contaminated, with enough text on both sides to survive GPT-3's 200-character window
    docs_a[7] = f"{stories[7]}\n{passage}\n{stories[41]}"
    docs_a.append("{ click here } buy now " * 3)  # 32: junk
    (root / "a").mkdir()
    (root / "a" / "stories.txt").write_text(
        "".join(f"{d}\n{EOT}\n" for d in docs_a), encoding="utf-8"
    )
    lines = [json.dumps({"text": s}) for s in stories[30:40]]
    lines.insert(2, '{"text": "broken')
    lines.insert(5, json.dumps({"body": "no text field"}))
    # Line 13: one valid JSON record but for a stray \xff byte (read with a replacement char).
    bad_byte = json.dumps({"text": "bad XFF byte " + stories[40][:600]}).encode()
    raw = "\n".join(lines).encode("utf-8") + b"\n" + bad_byte.replace(b"XFF", b"\xff") + b"\n"
    (root / "b.jsonl").write_bytes(raw)
    (root / "empty.jsonl").write_bytes(b"")
    config = f"""
output = "out"
docs_per_task = 7
[[sources]]
name = "stories"
paths = ["a/*.txt"]
share = 0.7
[[sources]]
name = "web"
paths = ["b.jsonl", "empty.jsonl"]
share = 0.3
[decontaminate]
eval_files = ["{shared_data}/eval/lambada_openai.jsonl", "{shared_data}/eval/arc_easy.jsonl"]
[split]
val_fraction = 0.1
[tokenize]
tokenizer = "{shared_data}/gpt2/vocab.json"
shard_tokens = 3000
"""
    (root / "pipeline.toml").write_text(config, encoding="utf-8")
    return {
        "root": root,
        "config": root / "pipeline.toml",
        "passage": passage,
        "story7": stories[7],
        "story41": stories[41],
    }


def _run(corpus: dict[str, Any], out: Path, **options: Any) -> Manifest:
    cfg = load_pipeline_config(corpus["config"])
    return run_pipeline(cfg, RunOptions(out=str(out), progress=False, **options))


@pytest.fixture(scope="module")
def baseline(corpus: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("baseline") / "ds"
    _run(corpus, out, workers=1)
    return out


def output_fingerprint(out: Path) -> dict[str, bytes]:
    """Every output file's bytes; of the manifest all but `created` (the build time, the one
    field the docs say differs between identical runs)."""
    files = {}
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.name != "manifest.json":
            files[str(path.relative_to(out))] = path.read_bytes()
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("created")
    files["manifest.json"] = json.dumps(manifest, sort_keys=True).encode()
    return files


def _find(out: Path, doc_id: str) -> tuple[str, int]:
    """(split, index) of a document by id, from the shards' document maps."""
    for split in ("train", "val"):
        maps = [r for p in sorted(out.glob(f"{split}_*.docs.jsonl.zst")) for r in read_records(p)]
        for i, record in enumerate(maps):
            if record["id"] == doc_id:
                return split, i
    raise AssertionError(f"{doc_id} is in no split")


def _removed(out: Path) -> list[dict[str, Any]]:
    return list(read_records(out / "pipeline" / "removed.jsonl.zst"))


def test_planted_duplicates_and_contamination_are_removed_and_audited(baseline: Path) -> None:
    removed = {r["id"]: r for r in _removed(baseline)}
    exact = removed["stories:stories.txt:30"]
    assert exact["stage"] == "exact_dedup"
    assert exact["duplicate_of"] == "stories:stories.txt:3"
    near = removed["stories:stories.txt:31"]
    assert near["stage"] == "near_dedup"
    assert near["duplicate_of"] == "stories:stories.txt:5"
    assert removed["stories:stories.txt:32"]["stage"] in ("gopher_quality", "c4", "fineweb")
    kept_ids = {r["id"] for p in baseline.glob("*.docs.jsonl.zst") for r in read_records(p)}
    assert {"stories:stories.txt:3", "stories:stories.txt:5"} <= kept_ids
    stats = json.loads((baseline / "pipeline" / "stats.json").read_text())
    assert stats["decontamination"]["lambada_openai"]["spans"] >= 1
    # The contaminated story survives without the benchmark passage.
    assert "stories:stories.txt:7" in kept_ids


def test_malformed_inputs_are_counted_with_file_and_line(baseline: Path) -> None:
    issues = json.loads((baseline / "pipeline" / "stats.json").read_text())["read_issues"]
    assert issues["counts"] == {
        "invalid JSON": 1, "missing text field": 1, "invalid UTF-8": 1, "empty file": 1
    }  # fmt: skip
    assert issues["total"] == 4
    where = {(Path(e["file"]).name, e.get("line"), e["kind"]) for e in issues["examples"]}
    assert where == {
        ("b.jsonl", 3, "invalid JSON"),  # the broken line
        ("b.jsonl", 6, "missing text field"),  # the record without a text field
        ("b.jsonl", 13, "invalid UTF-8"),  # the stray byte (the record itself is kept)
        ("empty.jsonl", None, "empty file"),
    }


def test_manifest_counts_equal_shard_contents(
    baseline: Path, shared_data: Path, corpus: dict[str, Any]
) -> None:
    ds = Dataset.open(baseline, verify=True)
    m = ds.manifest
    tok = read_any(shared_data / "gpt2" / "vocab.json")
    for name, split in ds.splits.items():
        maps = [
            r for p in sorted(baseline.glob(f"{name}_*.docs.jsonl.zst")) for r in read_records(p)
        ]
        assert len(maps) == split.n_documents == m.splits[name].documents
        by_source: dict[str, list[int]] = {}
        for i, record in enumerate(maps):
            tokens = split.document(i)
            assert int(tokens[-1]) == m.tokenizer.eot_id
            assert split.document_source(i) == record["source"]
            by_source.setdefault(record["source"], [0, 0])
            by_source[record["source"]][0] += 1
            by_source[record["source"]][1] += len(tokens)
        for src in m.sources:
            assert by_source.get(src.path, [0, 0]) == [
                src.documents.get(name, 0),
                src.tokens.get(name, 0),
            ]
    # The contaminated document's text no longer holds the passage.
    split, i = _find(baseline, "stories:stories.txt:7")
    text = tok.decode(ds.split(split).document(i)[:-1].tolist())
    assert corpus["passage"][:60] not in text
    assert corpus["story7"][:100] in text and corpus["story41"][-100:] in text
    funnel = m.pipeline["funnel"]
    for before, after in itertools.pairwise(funnel):
        assert after["in"] == before["kept"], (before["stage"], after["stage"])


def test_mixture_reaches_token_shares(baseline: Path) -> None:
    mix = Manifest.read(baseline).pipeline["mix"]
    longest = 2000  # tokens: no test document is longer
    total = sum(m["tokens_after"] for m in mix.values())
    for name, share in (("stories", 0.7), ("web", 0.3)):
        assert abs(mix[name]["tokens_after"] - share * total) <= 2 * longest, mix


def test_two_workers_give_byte_identical_output(
    corpus: dict[str, Any], baseline: Path, tmp_path: Path
) -> None:
    _run(corpus, tmp_path / "two", workers=2)
    assert output_fingerprint(tmp_path / "two") == output_fingerprint(baseline)


def test_global_pass_partitions_give_byte_identical_output(
    corpus: dict[str, Any], baseline: Path, tmp_path: Path
) -> None:
    """The baseline's global pass fits one partition; split into 3 and 7 it must not change."""
    for parts in (3, 7):
        _run(corpus, tmp_path / f"p{parts}", workers=2, partitions=parts)
        assert output_fingerprint(tmp_path / f"p{parts}") == output_fingerprint(baseline)


def test_ray_gives_byte_identical_output(
    corpus: dict[str, Any], baseline: Path, tmp_path: Path
) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        _run(corpus, tmp_path / "ray", workers=2, executor="ray")
    finally:
        ray.shutdown()
    assert output_fingerprint(tmp_path / "ray") == output_fingerprint(baseline)


def test_killed_run_resumes_and_redoes_only_unfinished_tasks(
    corpus: dict[str, Any], baseline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real: Callable[..., Any] = task_module.run_filter_task
    ran: list[int] = []

    def dies_after_three(task: Any) -> Any:
        if len(ran) == 3:
            raise KeyboardInterrupt  # as if the process were killed mid-run
        ran.append(task.index)
        return real(task)

    from kiln.data.pipeline import runner

    monkeypatch.setattr(runner, "run_filter_task", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        _run(corpus, tmp_path / "ds", workers=1)
    assert not (tmp_path / "ds").exists()
    assert ran == [0, 1, 2]
    ran.clear()

    def counting(task: Any) -> Any:
        ran.append(task.index)
        return real(task)

    monkeypatch.setattr(runner, "run_filter_task", counting)
    _run(corpus, tmp_path / "ds", workers=1)
    assert 0 not in ran and 3 in ran
    assert output_fingerprint(tmp_path / "ds") == output_fingerprint(baseline)


def test_changed_config_is_refused_without_force(
    corpus: dict[str, Any], baseline: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ds"
    _run(corpus, out, workers=1)
    before = (out / "manifest.json").read_bytes()
    _run(corpus, out, workers=1)  # same config: nothing to do
    assert (out / "manifest.json").read_bytes() == before
    cfg = load_pipeline_config(corpus["config"], ("seed=1",))
    with pytest.raises(KilnError, match="--force"):
        run_pipeline(cfg, RunOptions(out=str(out), progress=False))
    run_pipeline(cfg, RunOptions(out=str(out), progress=False, force=True))
    assert Manifest.read(out).config["seed"] == 1


def test_token_leads_back_to_document_and_removed_neighbours(baseline: Path) -> None:
    from kiln.data.pipeline.audit import explain_token

    ds = Dataset.open(baseline)
    maps = [r for p in sorted(baseline.glob("train_*.docs.jsonl.zst")) for r in read_records(p)]
    near = {f"stories:stories.txt:{k}" for k in (29, 28, 27)}
    index = next(i for i, r in enumerate(maps) if r["id"] in near)
    train = ds.split("train")
    position = sum(len(train.document(i)) for i in range(index)) + 3
    text = explain_token(ds, "train", position)
    assert maps[index]["id"] in text and "source stories" in text
    assert "exact_dedup" in text and "duplicate of stories:stories.txt:3" in text
    assert "near_dedup" in text


def test_trains_with_kiln_train(baseline: Path, tmp_path: Path) -> None:
    from kiln.train.config import load_train_config
    from kiln.train.trainer import Trainer

    configs = Path(__file__).resolve().parents[3] / "configs"
    cfg = load_train_config(
        configs / "tiny.toml",
        [f"data.dataset={baseline}", f"logging.run_dir={tmp_path / 'run'}", "train.max_steps=2"],
    )
    result = Trainer(cfg, cfg.logging.run_dir).run()
    assert result.step == 2 and np.isfinite(result.losses).all()


def test_cli_runs_prints_the_funnel_and_audits_a_token(
    corpus: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kiln.cli import main

    out = tmp_path / "cli"
    args = ["data", "run", str(corpus["config"]), "--out", str(out), "--workers", "1", "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "exact_dedup" in printed and "near_dedup" in printed and "stories" in printed
    assert main(["data", "inspect", str(out), "--token", "0"]) == 0
    assert "input " in capsys.readouterr().out
    assert main([*args[:-1], "--set", "seed=3", "--quiet"]) == 2  # changed config, no --force
    assert "--force" in capsys.readouterr().err


def test_html_and_warc_sources_are_extracted_and_redacted(
    shared_data: Path, tmp_path: Path
) -> None:
    stories = _stories(shared_data, 4)

    def page(i: int) -> str:
        body = "".join(f"<p>{p}</p>" for p in stories[i].split("\n"))
        return (
            f"<html><head><title>Story {i}</title></head><body><nav><a href='/'>Home</a> | "
            f"<a href='/about'>About us</a></nav><article><h1>Story {i}</h1>{body}"
            "<p>Write to admin@example.com or visit 8.8.8.8 today.</p></article>"
            "<footer>Copyright 2024 Example Corp. All rights reserved.</footer></body></html>"
        )

    (tmp_path / "pages").mkdir()
    for i in range(2):
        (tmp_path / "pages" / f"p{i}.html").write_text(page(i), encoding="utf-8")
    records = b""
    for i in (2, 3):
        http = b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n\r\n"
        http += page(i).encode()
        records += (
            (
                f"WARC/1.0\r\nWARC-Type: response\r\nWARC-Target-URI: http://example.com/{i}\r\n"
                f"WARC-Record-ID: <urn:uuid:{i}>\r\nContent-Type: application/http; "
                f"msgtype=response\r\nContent-Length: {len(http)}\r\n\r\n"
            ).encode()
            + http
            + b"\r\n\r\n"
        )
    (tmp_path / "crawl.warc.gz").write_bytes(gzip.compress(records))
    (tmp_path / "p.toml").write_text(
        f"""
[[sources]]
name = "pages"
paths = ["pages/*.html"]
[[sources]]
name = "crawl"
paths = ["crawl.warc.gz"]
[split]
val_fraction = 0.0
[tokenize]
tokenizer = "{shared_data}/gpt2/vocab.json"
""",
        encoding="utf-8",
    )
    cfg = load_pipeline_config(tmp_path / "p.toml")
    run_pipeline(cfg, RunOptions(out=str(tmp_path / "out"), progress=False))
    ds = Dataset.open(tmp_path / "out")
    tok = read_any(shared_data / "gpt2" / "vocab.json")
    texts = [tok.decode(ds.split("train").document(i).tolist()) for i in range(4)]
    assert sorted(src.path for src in ds.manifest.sources) == ["crawl", "pages"]
    for text in texts:
        assert "About us" not in text and "All rights reserved" not in text  # boilerplate gone
        assert "Write to <EMAIL> or visit <IP> today." in text  # PII redacted
    assert any(stories[2][:80] in t for t in texts) and any(stories[0][:80] in t for t in texts)


def test_a_run_cut_short_while_moving_into_place_finishes_without_recomputing(
    corpus: dict[str, Any], baseline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.data.pipeline import runner

    real_install = runner.install_dataset

    def dies(partial: Path, out: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "install_dataset", dies)
    with pytest.raises(KeyboardInterrupt):
        _run(corpus, tmp_path / "ds", workers=1)
    monkeypatch.setattr(runner, "install_dataset", real_install)
    monkeypatch.setattr(runner, "run_filter_task", lambda task: pytest.fail("recomputed"))
    _run(corpus, tmp_path / "ds", workers=1)
    assert output_fingerprint(tmp_path / "ds") == output_fingerprint(baseline)
    assert not (tmp_path / "ds.partial").exists()


def test_resume_refuses_changed_inputs_and_foreign_folders(
    corpus: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.data.pipeline import runner

    root = tmp_path / "corpus"
    shutil.copytree(corpus["root"], root, ignore=shutil.ignore_patterns("out*"))
    cfg = load_pipeline_config(root / "pipeline.toml")
    monkeypatch.setattr(runner, "run_global_stages", lambda *a: (_ for _ in ()).throw(SystemExit))
    with pytest.raises(SystemExit):
        run_pipeline(cfg, RunOptions(out=str(tmp_path / "ds"), progress=False))
    monkeypatch.undo()
    with open(root / "b.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "one more record"}) + "\n")
    with pytest.raises(KilnError, match="input files changed"):
        run_pipeline(cfg, RunOptions(out=str(tmp_path / "ds"), progress=False))
    foreign = tmp_path / "mine.partial"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(KilnError, match="not an unfinished"):
        run_pipeline(cfg, RunOptions(out=str(tmp_path / "mine"), progress=False, force=True))
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_a_replaced_tokenizer_file_counts_as_a_changed_config(
    corpus: dict[str, Any], tmp_path: Path, shared_data: Path
) -> None:
    from kiln.data.pipeline.runner import run_digest

    cfg = load_pipeline_config(corpus["config"])
    copy = tmp_path / "vocab.json"
    copy.write_bytes((shared_data / "gpt2" / "vocab.json").read_bytes())
    (tmp_path / "merges.txt").write_bytes((shared_data / "gpt2" / "merges.txt").read_bytes())
    moved = replace(cfg, tokenize=replace(cfg.tokenize, tokenizer=str(copy)))
    before = run_digest(moved)
    copy.write_bytes(copy.read_bytes().replace(b'"the"', b'"teh"'))
    assert run_digest(moved) != before


def test_sigkill_mid_run_then_restart_gives_the_uninterrupted_output(
    shared_data: Path, tmp_path: Path
) -> None:
    write_stories_pipeline(shared_data, tmp_path)
    cfg = load_pipeline_config(tmp_path / "p.toml")
    run_pipeline(cfg, RunOptions(out=str(tmp_path / "straight"), progress=False))

    out = tmp_path / "killed"
    args = ["data", "run", str(tmp_path / "p.toml"), "--out", str(out), "--workers", "1", "--quiet"]
    # The run SIGKILLs itself as its 6th filter task starts: a real kill at a known point, not
    # a poll racing the run (which could finish, or be killed mid-write, on a busy machine).
    killer = (
        "import os, signal, sys\n"
        "from kiln.data.pipeline import runner\n"
        "real, done = runner.run_filter_task, []\n"
        "def then_die(task):\n"
        "    if len(done) == 5:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    done.append(task.index)\n"
        "    return real(task)\n"
        "runner.run_filter_task = then_die\n"
        "from kiln.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    killed = subprocess.run([sys.executable, "-c", killer, *args], capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    markers = out.with_name("killed.partial") / "work" / "filter"
    done_before = len(list(markers.glob("*/stats.json")))
    assert done_before == 5
    assert not out.exists()

    command = [sys.executable, "-m", "kiln.cli", *args]
    restarted = subprocess.run(command, capture_output=True, text=True, check=True)
    assert f"filter: {done_before} of " in restarted.stderr  # only the rest was redone
    assert output_fingerprint(out) == output_fingerprint(tmp_path / "straight")


def test_a_dataset_a_killed_rebuild_set_aside_is_restored(
    corpus: dict[str, Any], baseline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between install's two renames: `out` is missing, the old dataset is in
    `.out.<pid>.old.tmp`; the next run moves it back (and removes the dead run's work folder)."""
    import subprocess
    import sys

    from kiln.data.pipeline import runner

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = int(gone.stdout)
    shutil.copytree(baseline, tmp_path / f".ds.{dead}.old.tmp")
    (tmp_path / f".ds.{dead}.work.tmp").mkdir()
    monkeypatch.setattr(runner, "run_filter_task", lambda task: pytest.fail("recomputed"))
    _run(corpus, tmp_path / "ds", workers=1)  # the same config: restored, nothing to do
    assert output_fingerprint(tmp_path / "ds") == output_fingerprint(baseline)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
