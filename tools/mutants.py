"""Break one behaviour at a time and check that a default test notices (`make mutants`).

Each mutant is a small monkeypatch applied inside the pytest process by a throwaway plugin
(`-p kiln_mutant_plugin`, written to a temporary directory); nothing in the repository changes.
First each distinct test selection runs once unmutated and must pass (else BASELINE FAILS,
exit 1). Then for each mutant the relevant default tests run with `-x`; the report says which
test failed ("caught by …"; MISMATCH when it is not the test EXPECTED names) or SURVIVED. A mutant whose target no longer exists (a function renamed, a line
rewritten) is an ERROR, never a survivor: update its row in MUTANTS.

Two kinds of mutation, both named by "module:Qualified.name":
- ("rewrite", [(old, new), …]): the function's source with each `old` snippet (which must occur)
  replaced by `new`, compiled in the function's own module and set in its place.
- ("replace", "expression"): the attribute replaced by the value of a Python expression, in
  which `original` is the attribute as it was.

    python tools/mutants.py            # every mutant
    python tools/mutants.py lr clip    # the mutants whose names start with these
    python tools/mutants.py grad -- tests/train/test_reference_loop.py  # other tests instead
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = "kiln.train.trainer:Trainer._train_step"
EVALUATE = "kiln.train.trainer:Trainer.evaluate"
GOPHER = "kiln.data.pipeline.filter.quality_gopher:GopherQuality.apply"
TRAIN_TESTS = [
    "tests/train/test_reference_loop.py",
    "tests/train/test_trainer.py",
    "tests/train/test_cli.py",
    "tests/train/test_samples_and_loggers.py",
]
MIX_TESTS = ["tests/data/pipeline/mix/test_mixture_shards.py", "tests/data/pipeline/test_runner.py"]
# The agreement with datatrove (real documents first, then one made-up document per rule).
AGREEMENT_TESTS = [
    "tests/data/pipeline/filter/test_quality_gopher.py::test_agrees_with_datatrove_on_real_documents",
    "tests/data/pipeline/filter/test_rules_fire_in_both.py",
]

# name: (target, kind, change, tests to run, extra pytest arguments)
MUTANTS: dict[str, tuple[str, str, object, list[str], list[str]]] = {
    "lr_schedule_not_applied": (
        "kiln.train.trainer:set_lr", "replace",
        "lambda optimizer, m: optimizer.param_groups[0]['peak_lr'] * m",  # reports, never sets
        TRAIN_TESTS, [],
    ),
    "grad_clip_off": (
        TRAIN, "rewrite", [("if cfg.train.grad_clip > 0:", "if False:")], TRAIN_TESTS, [],
    ),
    "micro_losses_summed": (
        TRAIN, "rewrite", [("(loss / self.accum).backward()", "loss.backward()")],
        TRAIN_TESTS, [],
    ),
    "val_with_dropout": (
        EVALUATE, "rewrite", [("self.model.eval()", "self.model.train()")], TRAIN_TESTS, [],
    ),
    "val_mean_per_batch": (
        EVALUATE, "rewrite",
        [(".float() * weight", ".float()"), ("/ self.val_windows", "/ len(self.val_batches)")],
        TRAIN_TESTS, [],
    ),
    "rng_not_restored_on_resume": (
        "kiln.train.checkpoint:restore_rng", "replace", "lambda *args, **kwargs: None",
        TRAIN_TESTS, [],
    ),
    "tokenizer_resume_retrains": (
        "kiln.tokenizer.train:_State.exists", "replace", "lambda self: False",
        ["tests/tokenizer/test_train.py", "tests/tokenizer/test_streaming_and_bad_input.py"],
        ["-k", "resume"],
    ),
    "mixture_shares_ignored": (
        "kiln.data.pipeline.runner:plan_mixture", "replace",
        "lambda sources: original([__import__('dataclasses').replace(s, share=None, rate=None)"
        " for s in sources])",
        MIX_TESTS, ["-k", "mixture"],
    ),
    "mixture_plan_not_written": (
        "kiln.data.pipeline.runner:_copies", "rewrite",
        [("copies[np.array(indices, dtype=np.int64)] = repeats[name]", "pass")],
        MIX_TESTS, ["-k", "mixture"],
    ),
    "gopher_stop_words_off": (
        GOPHER, "rewrite",
        [('return "gopher_quality.stop_words"', "pass")],
        AGREEMENT_TESTS, [],
    ),
    "gopher_ellipsis_lines_off": (
        GOPHER, "rewrite",
        [('return "gopher_quality.ellipsis_lines"', "pass")],
        AGREEMENT_TESTS, [],
    ),
}  # fmt: skip

# The test each mutant is expected to be caught by (a node id prefix): caught by another one
# is a MISMATCH, so a test that starts failing for an unrelated reason is not taken as the catch.
REF = "tests/train/test_reference_loop.py::"
EXPECTED: dict[str, str] = {
    "lr_schedule_not_applied": REF + "test_trainer_equals_a_hand_written_loop",
    "grad_clip_off": REF + "test_trainer_equals_a_hand_written_loop",
    "micro_losses_summed": REF + "test_trainer_equals_a_hand_written_loop",
    "val_with_dropout": REF + "test_val_loss_equals_kiln_eval_on_the_same_windows",
    "val_mean_per_batch": REF + "test_val_loss_equals_kiln_eval_on_the_same_windows",
    "rng_not_restored_on_resume": (
        "tests/train/test_trainer.py::test_resume_equals_an_uninterrupted_run_bit_for_bit"
    ),
    "tokenizer_resume_retrains": "tests/tokenizer/test_train.py::test_resume_equals_uninterrupted",
    "mixture_shares_ignored": "tests/data/pipeline/mix/test_mixture_shards.py::"
    "test_each_sources_written_tokens_reach_its_share_within_one_document",
    "mixture_plan_not_written": "tests/data/pipeline/mix/test_mixture_shards.py::"
    "test_each_sources_written_tokens_reach_its_share_within_one_document",
    "gopher_stop_words_off": AGREEMENT_TESTS[0],
    "gopher_ellipsis_lines_off": AGREEMENT_TESTS[0],
}

PLUGIN = '''
"""Applies the mutant named by $KILN_MUTANT (written by tools/mutants.py; throwaway)."""
import importlib, inspect, json, os, textwrap
import pytest

_SPEC = json.loads(os.environ["KILN_MUTANT"])
_REPORT = os.environ["KILN_MUTANT_REPORT"]


def _resolve(target):
    module_name, _, qualname = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    if attr not in vars(owner):
        raise LookupError(f"{target}: no attribute {attr!r} in {owner!r}")
    return owner, attr, vars(owner)[attr]


def _apply(target, kind, change):
    owner, attr, original = _resolve(target)
    if kind == "replace":
        value = eval(change, {"original": original})
    else:
        source = textwrap.dedent(inspect.getsource(original))
        for old, new in change:
            if old not in source:
                raise LookupError(f"{target}: the snippet {old!r} is not in its source")
            source = source.replace(old, new)
        func = inspect.unwrap(original)
        namespace = {}
        exec(compile(source, f"<mutant of {target}>", "exec"), func.__globals__, namespace)
        value = namespace[func.__name__]
    setattr(owner, attr, value)


def pytest_configure(config):
    try:
        _apply(_SPEC["target"], _SPEC["kind"], _SPEC["change"])
    except Exception as exc:  # a moved target must fail loudly, never look like a survivor
        with open(_REPORT, "w") as handle:
            json.dump({"error": f"{type(exc).__name__}: {exc}"}, handle)
        pytest.exit(f"mutant not applied: {exc}", returncode=3)


def pytest_runtest_logreport(report):
    if report.failed:
        with open(_REPORT, "a") as handle:
            crash = getattr(report.longrepr, "reprcrash", None)
            why = crash.message.splitlines()[0][:100] if crash is not None else ""
            handle.write(json.dumps({"failed": report.nodeid, "why": why}) + "\\n")
'''


def _pytest(
    tests: list[str], extra: list[str], plugin_dir: Path, env_extra: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the default (not slow) tests `tests` with `-x`; the mutant plugin when one is set."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(plugin_dir), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
        **env_extra,
    }
    plugin = ["-p", "kiln_mutant_plugin"] if "KILN_MUTANT" in env_extra else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", *plugin,
           "-p", "no:cacheprovider", *extra, *tests]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return proc, time.perf_counter() - started


def selection(name: str, override: list[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The (tests, extra pytest arguments) mutant `name` runs."""
    _, _, _, tests, extra = MUTANTS[name]
    return (tuple(override), ()) if override else (tuple(tests), tuple(extra))


def run_baseline(
    tests: tuple[str, ...], extra: tuple[str, ...], plugin_dir: Path
) -> tuple[bool, str, float]:
    """Run a selection unmutated: (whether it passed, its last line, seconds).

    A mutant is only "caught" by a failure the unmutated code does not have.
    """
    proc, seconds = _pytest(list(tests), list(extra), plugin_dir, {})
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return proc.returncode == 0 and " passed" in proc.stdout, last[0], seconds


def run_mutant(
    name: str, plugin_dir: Path, override: list[str] | None = None
) -> tuple[str, str, float]:
    """Run one mutant's tests (or the pytest arguments `override`): (status, detail, seconds)."""
    target, kind, change, _, _ = MUTANTS[name]
    tests, extra = selection(name, override)
    report = plugin_dir / f"{name}.report"
    report.unlink(missing_ok=True)
    env_extra = {
        "KILN_MUTANT": json.dumps({"target": target, "kind": kind, "change": change}),
        "KILN_MUTANT_REPORT": str(report),
    }
    proc, seconds = _pytest(list(tests), list(extra), plugin_dir, env_extra)
    lines = report.read_text().splitlines() if report.exists() else []
    records = [json.loads(line) for line in lines if line.strip()]
    errors = [r["error"] for r in records if "error" in r]
    if errors:
        return "ERROR", errors[0], seconds
    failed = [r for r in records if "failed" in r]
    if failed:
        caught_by = failed[0]["failed"]
        expected = EXPECTED.get(name)
        if override is None and expected is not None and not caught_by.startswith(expected):
            return "MISMATCH", f"{caught_by}, expected {expected}  ({failed[0]['why']})", seconds
        return "caught", f"{caught_by}  ({failed[0]['why']})", seconds
    if proc.returncode == 5 or " passed" not in proc.stdout:  # nothing ran: not a survivor either
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return "ERROR", f"no test ran (rc {proc.returncode}): {' | '.join(tail)}", seconds
    if proc.returncode != 0:
        return (
            "ERROR",
            f"pytest rc {proc.returncode}: {proc.stdout.strip().splitlines()[-1:]}",
            seconds,
        )
    return "SURVIVED", proc.stdout.strip().splitlines()[-1], seconds


def main(argv: list[str]) -> int:
    """Run the chosen mutants (all by default); exit 1 if any survived or could not be applied."""
    override = argv[argv.index("--") + 1 :] if "--" in argv else None
    argv = argv[: argv.index("--")] if "--" in argv else argv
    names = [n for n in MUTANTS if not argv or any(n.startswith(a) for a in argv)]
    if not names:
        print(f"no mutant matches {argv}; known: {', '.join(MUTANTS)}", file=sys.stderr)
        return 2
    bad = 0
    with tempfile.TemporaryDirectory(prefix="kiln-mutants-") as tmp:
        plugin_dir = Path(tmp)
        (plugin_dir / "kiln_mutant_plugin.py").write_text(PLUGIN)
        width = max(map(len, names))
        # Each distinct selection once, unmutated: a test that already fails would "catch" all.
        for tests, extra in dict.fromkeys(selection(n, override) for n in names):
            passed, last, seconds = run_baseline(tests, extra, plugin_dir)
            label = " ".join([*extra, *tests])
            print(f"{'baseline':<{width}}  {seconds:6.1f}s  {label}: {last}", flush=True)
            if not passed:
                print(f"BASELINE FAILS: {label} fails unmutated; fix it first", flush=True)
                return 1
        for name in names:
            status, detail, seconds = run_mutant(name, plugin_dir, override)
            bad += status != "caught"
            shown = f"caught by {detail}" if status == "caught" else f"{status}: {detail}"
            print(f"{name:<{width}}  {seconds:6.1f}s  {shown}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
