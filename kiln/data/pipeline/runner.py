"""`run_pipeline`: plan tasks, filter, deduplicate, decontaminate, tokenize, mix, write shards.

The run is built in `<out>.partial/` and renamed to `<out>` when complete. Every phase leaves
completion markers there, so a killed run started again with the same config redoes only what
did not finish; a different config is refused unless `force`, which starts afresh (and replaces
a finished `<out>` only once the new one is complete).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln import config as cfgio
from kiln.data.manifest import MANIFEST_NAME, Manifest
from kiln.data.pipeline.config import InputFile, PipelineConfig, expand_sources
from kiln.data.pipeline.executors import Executor, make_executor
from kiln.data.pipeline.global_stages import GLOBAL_STATS, run_global_stages
from kiln.data.pipeline.mix.survivors import plan_copies, surviving_documents
from kiln.data.pipeline.mix.writer import write_dataset
from kiln.data.pipeline.records import (
    load_arrays,
    read_records,
    write_records,
)
from kiln.data.pipeline.tasks import (
    STATS,
    FilterTask,
    TokenizeTask,
    is_done,
    run_filter_task,
    run_tokenize_task,
)
from kiln.data.tokenize_shards import build_path, install_dataset, remove_abandoned_builds
from kiln.errors import KilnError
from kiln.io import sha256_file, write_json_atomic

RUN_FILE = "run.json"
PLAN_FILE = "plan.json"
PIPELINE_DIR = "pipeline"


@dataclass(frozen=True)
class RunOptions:
    """How to run (not what to compute): none of this changes the output."""

    out: str = ""
    workers: int = 1
    executor: str = "local"
    address: str | None = None
    force: bool = False
    progress: bool = True
    memory_mb: int = 2048  # per process in the global pass: it sets the number of partitions
    partitions: int = 0  # the global pass's partitions (0: from memory_mb); never the output


def _log(message: str, progress: bool) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _read_digest(directory: Path) -> str | None:
    try:
        return json.loads((directory / PIPELINE_DIR / RUN_FILE).read_text())["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def model_files(cfg: PipelineConfig) -> list[str]:
    """The lists and models the enabled per-document stages read."""
    from kiln.data.pipeline.filter.bad_words import LIST_DIR, shipped_languages

    q = cfg.quality
    named = []
    if q.c4.enabled and q.c4.bad_words_file:
        named.append(q.c4.bad_words_file)
    if cfg.bad_words.enabled:
        if cfg.bad_words.words_file:
            named.append(cfg.bad_words.words_file)
        else:
            langs = cfg.bad_words.languages or shipped_languages()
            named.extend(str(LIST_DIR / f"{lang}.txt") for lang in langs)
    if cfg.url_blocklist.enabled:
        named.append(cfg.url_blocklist.file)
    for stage in (q.classifier, q.perplexity):
        if stage.enabled:
            named.append(stage.model)
    return named


def model_summaries(cfg: PipelineConfig) -> dict[str, dict[str, Any]]:
    """What the report says of each model-based stage: its model's training record and the
    threshold or cutoffs it applied."""
    from kiln.data.pipeline.tasks import build_stages

    out: dict[str, dict[str, Any]] = {}
    for name, stage in build_stages(cfg):
        if name == "classifier":
            info = {k: v for k, v in stage.model.info.items() if k != "negative_quantiles"}
            out[name] = {"model": stage.config.model, "threshold": stage.threshold, **info}
        elif name == "perplexity":
            info = {k: v for k, v in stage.model.info.items() if k != "sample_quantiles"}
            out[name] = {
                "model": stage.config.model,
                "head_cutoff": stage.head_cutoff,
                "tail_cutoff": stage.tail_cutoff,
                "keep": list(stage.config.keep),
                "order": stage.model.order,
                **info,
            }
    return out


def run_digest(cfg: PipelineConfig) -> str:
    """The config's digest plus the contents of the files it names besides the inputs (the
    tokenizer, evaluation sets, word lists, blocklists, quality models): replacing one at the
    same path is a change."""
    parts = [cfg.digest()]
    named = [cfg.tokenize.tokenizer, *cfg.decontaminate.eval_files]
    named.extend(model_files(cfg))
    for path in named:
        parts.append(sha256_file(path) if os.path.isfile(path) else f"missing:{path}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _prepare(out: Path, partial: Path, cfg: PipelineConfig, force: bool) -> bool:
    """Check what is on disk; return True when `out` is already this config's finished output."""
    digest = run_digest(cfg)
    remove_abandoned_builds(out)  # may move back the dataset a killed rebuild had set aside
    # `.<out>.old.*` (no PID): left by kiln versions before PID-named folders.
    leftovers = sorted(out.parent.glob(f".{out.name}.old.*")) if out.parent.is_dir() else []
    if leftovers and not out.exists():
        raise KilnError(
            f"{out} is missing but {leftovers[0]} holds the dataset it replaced when a rebuild "
            f"was cut short; move it back to {out} (or delete it) and run again"
        )
    if out.exists():
        if not (out / MANIFEST_NAME).is_file() or _read_digest(out) is None:
            raise KilnError(f"{out} exists and is not a `kiln data run` output; choose another")
        if _read_digest(out) == digest and not force:
            return True
        if not force:
            raise KilnError(
                f"{out} was made by a different pipeline config; pass --force to rebuild it "
                f"(the old dataset is replaced only when the new one is complete)"
            )
    _check_inputs(cfg)  # before anything is written: a typo must not leave a run behind
    if partial.exists():
        found = _read_digest(partial)
        if found is None and any(partial.iterdir()):
            raise KilnError(f"{partial} exists and is not an unfinished `kiln data run`; move it")
        if found is not None and found != digest and not (partial / "work" / PLAN_FILE).is_file():
            # It never planned a task (say, a source path matched nothing): nothing to keep.
            shutil.rmtree(partial)
        elif found is not None and found != digest:
            if not force:
                raise KilnError(
                    f"{partial} holds an unfinished run of a different config; pass --force to "
                    f"discard it and start again"
                )
            shutil.rmtree(partial)
    (partial / PIPELINE_DIR).mkdir(parents=True, exist_ok=True)
    if _read_digest(partial) is None:
        plain = cfgio.to_dict(cfg)
        write_json_atomic(partial / PIPELINE_DIR / RUN_FILE, {"digest": digest, "config": plain})
        (partial / PIPELINE_DIR / "config.toml").write_text(
            cfgio.to_toml(plain, header=f"kiln data run config (digest {digest})"),
            encoding="utf-8",
        )
    return False


def _check_inputs(cfg: PipelineConfig) -> None:
    """Every source matches files, the tokenizer loads, and so does every stage's word list,
    blocklist and model (evaluation files: at config load)."""
    from kiln.data.pipeline.tasks import build_stages
    from kiln.data.tokenize_shards import load_tokenizer_entry

    expand_sources(cfg)
    load_tokenizer_entry(cfg.tokenize.tokenizer, cfg.tokenize.eot_token)
    build_stages(cfg)


def _count_task(file: InputFile, spec_args: dict[str, Any], every: int, index: str) -> int:
    """Count a file's records; a compressed txt/jsonl file's counting pass also writes its
    byte-offset index (`index`), so that its tasks start at their own ranges."""
    from kiln.data.pipeline.read.offsets import build_index, wants_index
    from kiln.data.pipeline.read.readers import count_records

    if index and wants_index(file.path, file.format):
        separator = spec_args["separator"].encode("utf-8")
        return build_index(file.path, file.format, separator, every, index)
    return count_records(file.path, file.format, **spec_args)


def _count_one(args: tuple[InputFile, dict[str, Any], int, str]) -> int:
    return _count_task(*args)


def _file_identity(path: str) -> list[Any]:
    st = os.stat(path)
    return [path, st.st_size, st.st_mtime_ns]


def _reader_args(cfg: PipelineConfig, source: str) -> dict[str, Any]:
    spec = next(s for s in cfg.sources if s.name == source)
    return {"separator": spec.separator}


def _plan(cfg: PipelineConfig, work: Path, executor: Executor, progress: bool) -> list[FilterTask]:
    """Split every input file into tasks of `docs_per_task` records (counts kept in plan.json)."""
    files = expand_sources(cfg)
    identity = [_file_identity(f.path) for f in files]
    plan_path = work / PLAN_FILE
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
        if plan.get("identity") != identity:
            raise KilnError(
                f"the input files changed since this run started ({plan_path} lists "
                f"{len(plan.get('identity', []))} files, by path, size and time); pass --force "
                f"to start again"
            )
        counts = plan["records"]
    else:
        jobs = [
            (f, _reader_args(cfg, f.source), cfg.docs_per_task, _index_of(work, k, f))
            for k, f in enumerate(files)
        ]
        counts = [0] * len(files)
        for i, n in executor.map(_count_one, jobs, desc="count records", unit="file"):
            counts[i] = n
        write_json_atomic(plan_path, {"identity": identity, "records": counts})
    tasks: list[FilterTask] = []
    for k, (f, n) in enumerate(zip(files, counts, strict=True)):
        spec = next(s for s in cfg.sources if s.name == f.source)
        for start in range(0, max(n, 1), cfg.docs_per_task):
            tasks.append(
                FilterTask(
                    index=len(tasks),
                    file=f,
                    start=start,
                    stop=min(n, start + cfg.docs_per_task),
                    config=cfg,
                    workdir=str(work),
                    text_field=spec.text_field,
                    id_field=spec.id_field,
                    separator=spec.separator,
                    offset_index=_index_of(work, k, f) if n > cfg.docs_per_task else "",
                )
            )
    _log(f"plan: {len(files)} files, {sum(counts):,} records, {len(tasks)} tasks", progress)
    return tasks


def _index_of(work: Path, number: int, file: InputFile) -> str:
    """The byte-offset index of the run's `number`-th input file, if it gets one ("" if not)."""
    from kiln.data.pipeline.read.offsets import index_path, wants_index

    return index_path(work, number) if wants_index(file.path, file.format) else ""


def _run_missing(
    executor: Executor, fn: Any, tasks: list[Any], desc: str, sizes: list[int]
) -> None:
    todo = [i for i, t in enumerate(tasks) if not is_done(t.dir)]
    if len(todo) < len(tasks):
        print(
            f"{desc}: {len(tasks) - len(todo)} of {len(tasks)} tasks already done", file=sys.stderr
        )
    runs = executor.map(
        fn, [tasks[i] for i in todo], desc=desc, unit="doc", sizes=[sizes[i] for i in todo]
    )
    for _ in runs:
        pass


def _in_order(executor: Executor, desc: str) -> Any:
    """`executor.map` as a list of results in job order (the global pass's mapper)."""

    def run(fn: Any, jobs: Any) -> list[Any]:
        results = executor.map(fn, jobs, desc=desc, unit="job")
        return [r for _, r in sorted(results, key=lambda item: item[0])]

    return run


def _load_stats(task_dir: Path) -> dict[str, Any]:
    return json.loads((task_dir / STATS).read_text())


def _funnel(
    cfg: PipelineConfig,
    filter_stats: list[dict[str, Any]],
    global_stats: dict[str, Any],
    tok_stats: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Stage by stage: documents in, kept, and removed by reason (overall and per source)."""
    rows: list[dict[str, Any]] = []
    records = sum(s["records"] for s in filter_stats)
    documents = sum(s["documents"] for s in filter_stats)
    rows.append({"stage": "read", "in": records, "kept": documents, "removed": {}, "by_source": {}})
    stage_names: list[str] = []
    for s in filter_stats:
        for name in s["stage_in"]:
            if name not in stage_names:
                stage_names.append(name)
    for name in stage_names:
        total_in = sum(s["stage_in"].get(name, 0) for s in filter_stats)
        removed: dict[str, int] = {}
        by_source: dict[str, int] = {}
        for s in filter_stats:
            for reason, n in s["removed"].get(name, {}).items():
                removed[reason] = removed.get(reason, 0) + n
                by_source[s["source"]] = by_source.get(s["source"], 0) + n
        rows.append(
            {
                "stage": name,
                "in": total_in,
                "kept": total_in - sum(removed.values()),
                "removed": removed,
                "by_source": by_source,
                "changed": sum(s.get("changed", {}).get(name, 0) for s in filter_stats),
            }
        )
    rows.extend(global_stats["funnel"])
    if cfg.dedup.lines.enabled:
        lines = [s["line_dedup"] for s in tok_stats if "line_dedup" in s]
        total = {k: sum(s[k] for s in lines) for k in ("in", "changed", "units_removed", "emptied")}
        rows.append(
            {
                "stage": "line_dedup",
                "in": total["in"],
                "kept": total["in"] - total["emptied"],
                "removed": {"line_dedup.empty": total["emptied"]} if total["emptied"] else {},
                "by_source": {},
                "changed": total["changed"],
                "details": {
                    **(global_stats.get("line_dedup") or {}),
                    "units_removed": total["units_removed"],
                },
            }
        )
    return rows


def run_pipeline(cfg: PipelineConfig, opts: RunOptions) -> Manifest:
    """Run the whole pipeline; return the manifest of the finished dataset."""
    out_text = opts.out or cfg.output
    if not out_text:
        raise KilnError("no output directory: give --out or `output` in the config")
    out = Path(out_text)
    partial = out.with_name(out.name + ".partial")
    if _prepare(out, partial, cfg, opts.force):
        _log(f"{out} is already complete for this config; nothing to do", opts.progress)
        return Manifest.read(out)
    if (partial / MANIFEST_NAME).is_file():
        _log(f"{partial} is complete; moving it into place", opts.progress)
        _install(partial, out)
        return Manifest.read(out)
    work = partial / "work"
    work.mkdir(parents=True, exist_ok=True)
    executor = make_executor(opts.executor, opts.workers, opts.address, opts.progress)
    try:
        try:
            tasks = _plan(cfg, work, executor, opts.progress)
        except Exception:
            if not (work / PLAN_FILE).is_file():  # e.g. a corrupt input: no work done to keep
                shutil.rmtree(partial, ignore_errors=True)
            raise
        _run_missing(executor, run_filter_task, tasks, "filter", [t.stop - t.start for t in tasks])
        filter_stats = [_load_stats(t.dir) for t in tasks]
        global_dir = work / "global"
        if not (global_dir / GLOBAL_STATS).is_file():
            _log("dedup + decontaminate: global pass", opts.progress)
            run_global_stages(
                cfg,
                [t.dir for t in tasks],
                global_dir,
                _in_order(executor, "global pass"),
                opts.memory_mb << 20,
                opts.partitions,
            )
        global_stats = json.loads((global_dir / GLOBAL_STATS).read_text())
        tok_tasks = [
            TokenizeTask(
                t.index,
                str(work),
                cfg.tokenize.tokenizer,
                cfg.tokenize.eot_token,
                cfg.removed_samples,
                cfg.dedup.lines if cfg.dedup.lines.enabled else None,
            )
            for t in tasks
        ]
        kept = [int(load_arrays(global_dir / f"{t.index:06d}.npz")["keep"].sum()) for t in tasks]
        _run_missing(executor, run_tokenize_task, tok_tasks, "tokenize", kept)
    finally:
        executor.close()
    tok_stats = [_load_stats(t.dir) for t in tok_tasks]
    docs = surviving_documents(cfg, work, [t.index for t in tok_tasks])
    copies, mix_summary = plan_copies(cfg, docs)
    warnings = [
        f"source {name!r} has no training documents left after filtering"
        + ("; its share is not met" if m["target_share"] else "")
        for name, m in mix_summary.items()
        if m["tokens_before"] == 0
    ]
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    _log("writing shards", opts.progress)
    samples = _write_audit_log(cfg, partial, tasks, global_dir, [t.dir for t in tok_tasks])
    samples.update(global_stats["samples"])  # the global stages chose theirs when they ran
    stats = {
        "funnel": _funnel(cfg, filter_stats, global_stats, tok_stats),
        "mix": mix_summary,
        "decontamination": _merge_decontam(tok_stats),
        "read_issues": _merge_issues(filter_stats),
        "histograms": _merge_histograms(filter_stats),
        "removed_samples": samples,
        "output_samples": _merge_samples(tok_stats, cfg.removed_samples),
        "digest": run_digest(cfg),
        "warnings": warnings,
        "models": model_summaries(cfg),
    }
    manifest = write_dataset(cfg, partial, work, docs, copies, stats, opts.progress, out)
    _install(partial, out)
    return manifest


def _merge_decontam(tok_stats: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    merged: dict[str, dict[str, int]] = {}
    for s in tok_stats:
        for task, counts in s.get("decontam", {}).items():
            entry = merged.setdefault(task, {"documents": 0, "spans": 0, "dropped": 0})
            for key, n in counts.items():
                entry[key] = entry.get(key, 0) + n
    return dict(sorted(merged.items()))


def _merge_samples(tok_stats: list[dict[str, Any]], limit: int) -> dict[str, list[Any]]:
    """The first few example output documents per kind, in task order."""
    merged: dict[str, list[Any]] = {}
    for s in tok_stats:
        for key, records in s.get("samples", {}).items():
            bucket = merged.setdefault(key, [])
            bucket.extend(records[: limit - len(bucket)])
    return dict(sorted(merged.items()))


def _merge_issues(filter_stats: list[dict[str, Any]]) -> dict[str, Any]:
    from kiln.data.pipeline.read.readers import ReadIssues

    merged = ReadIssues()
    for s in filter_stats:
        merged.merge(ReadIssues.from_json(s["issues"]))
    return merged.to_json()


def _merge_histograms(filter_stats: list[dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
    from kiln.data.pipeline.tasks import CHAR_BINS, SCORE_BINS

    merged: dict[str, dict[str, list[int]]] = {
        "bins": {
            "log10_chars": CHAR_BINS.tolist(),
            "lang_score": SCORE_BINS.tolist(),
            "classifier_score": SCORE_BINS.tolist(),
        }
    }
    for s in filter_stats:
        per = merged.setdefault(s["source"], {})
        for key, counts in s["hist"].items():
            old = per.get(key, [0] * len(counts))
            per[key] = [a + b for a, b in zip(old, counts, strict=True)]
    return merged


def _write_audit_log(
    cfg: PipelineConfig,
    partial: Path,
    tasks: list[FilterTask],
    global_dir: Path,
    tok_dirs: list[Path],
) -> dict[str, list[dict[str, Any]]]:
    """Write every removal (per-document stages in task order, then the global stages, then
    documents line dedup emptied) and return a few examples per (stage, reason): the first in
    input order that carry an excerpt."""
    samples: dict[str, list[dict[str, Any]]] = {}

    def sampled(records: Any) -> Any:
        for record in records:
            if "excerpt" in record:
                bucket = samples.setdefault(f"{record['stage']}/{record['reason']}", [])
                if len(bucket) < cfg.removed_samples:
                    bucket.append(record)
            yield record

    def all_removals() -> Any:
        for t in tasks:
            yield from sampled(read_records(t.dir / "removed.jsonl.zst"))
        yield from read_records(global_dir / "removed.jsonl.zst")
        for d in tok_dirs:
            path = d / "removed.line_dedup.jsonl.zst"
            if path.is_file():
                yield from sampled(read_records(path))

    write_records(partial / PIPELINE_DIR / "removed.jsonl.zst", all_removals())
    return samples


def _install(partial: Path, out: Path) -> None:
    """Set the intermediate files aside, move the finished dataset into place, then delete them.

    `manifest.json` is the last file `write_dataset` writes, so a `.partial` holding one is
    complete: a run cut short after that point only has this step left to do.
    """
    work = partial / "work"
    if work.exists():
        trash = build_path(out, "work")  # a kill while deleting it: the next start finishes
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(work, trash)
        shutil.rmtree(trash)
    install_dataset(partial, out)
