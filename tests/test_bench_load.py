"""bench/_load.py: the record of the load a benchmark ran under, and the refusal of busy records.

No benchmark runs here: the scripts are imported and stopped by the load check they must make
before measuring anything.
"""

import argparse
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

from bench import _load
from bench._load import MAX_START_LOAD, add_noisy_flag, begin, cpu_info
from tests.fixtures import BENCH, bench_script

CPUINFO = """processor\t: 0
model name\t: Test CPU 9000
flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_tile amx_bf16
processor\t: 1
model name\t: Test CPU 9000
flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_tile amx_bf16
"""


def fixed(*values):
    """A getloadavg (or clock) returning `values` in turn, the last one again once they run out."""
    queue = list(values)
    return lambda: queue.pop(0) if len(queue) > 1 else queue[0]


@pytest.fixture
def cpuinfo(tmp_path: Path) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    return path


def test_busy_machine_is_refused_with_one_line_naming_the_load() -> None:
    with pytest.raises(SystemExit) as exc:
        begin("bench/x.py", noisy=False, getloadavg=fixed((3.25, 2.0, 1.0)))
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("bench/x.py: not recording")
    assert "3.25" in message and "--noisy" in message


def test_load_at_the_threshold_is_quiet_enough() -> None:
    m = begin("bench/x.py", noisy=False, getloadavg=fixed((MAX_START_LOAD, 9.0, 9.0)))
    assert m.noisy is False


def test_noisy_flag_keeps_the_record_and_marks_it(cpuinfo: Path) -> None:
    m = begin(
        "bench/x.py",
        noisy=True,
        getloadavg=fixed((4.0, 3.0, 2.0), (5.5, 3.5, 2.5)),
        clock=fixed(1_000_000.0, 1_000_060.0),
        cpuinfo=cpuinfo,
    )
    doc = m.stamp({"tok_s": 123.0})
    assert doc["tok_s"] == 123.0
    assert doc["noisy"] is True
    rec = doc["measured"]
    assert rec["noisy"] is True
    assert rec["loadavg_start"] == [4.0, 3.0, 2.0]
    assert rec["loadavg_end"] == [5.5, 3.5, 2.5]
    assert "4.00" in rec["noisy_reason"]
    assert rec["started"] == "1970-01-12 13:46:40 UTC"
    assert rec["ended"] == "1970-01-12 13:47:40 UTC"
    line = m.line()
    assert line.startswith("**noisy**") and "4.00" in line


def test_noisy_flag_on_a_quiet_start_keeps_a_quiet_record() -> None:
    m = begin("bench/x.py", noisy=True, getloadavg=fixed((1.2, 1.3, 1.7)))
    assert m.noisy is False
    assert not m.line().startswith("**noisy**")


def test_quiet_record_carries_load_time_cpu_and_threads(cpuinfo: Path) -> None:
    m = begin(
        "bench/x.py",
        noisy=False,
        getloadavg=fixed((0.3, 0.2, 0.1), (0.9, 0.4, 0.2)),
        cpuinfo=cpuinfo,
    )
    rec = m.stamp({})["measured"]
    assert "noisy" not in m.stamp({})
    assert rec["noisy"] is False and "noisy_reason" not in rec
    assert rec["loadavg_start"] == [0.3, 0.2, 0.1]
    assert rec["cpu"] == "Test CPU 9000"
    assert rec["cpu_flags"] == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert rec["torch_threads"] == torch.get_num_threads()
    json.dumps(rec)  # it goes into JSON files as it is
    line = m.line()
    assert "noisy" not in line
    assert "0.30 0.20 0.10 at start" in line and "Test CPU 9000" in line


def test_cpu_info_without_proc_cpuinfo(tmp_path: Path) -> None:
    info = cpu_info(tmp_path / "missing")
    assert info["cpu"] and info["cpu_flags"] == []


def test_noisy_flag_parses() -> None:
    parser = argparse.ArgumentParser()
    add_noisy_flag(parser)
    assert parser.parse_args(["--noisy"]).noisy is True
    assert parser.parse_args([]).noisy is False


def test_speedrun_log_table_marks_old_entries_taken_under_load(tmp_path: Path, capsys) -> None:
    speedrun = _script("speedrun")
    base = {"date": "d", "label": "L", "name": "n", "overrides": [], "tokenizer": "4096",
            "budget": "10m", "clock": "wall", "threads": 1, "side_by_side": 2, "steps": 1,
            "tokens": 1, "tokens_per_s": 1, "holdout_bpb": 1.0}  # fmt: skip
    log = tmp_path / "log.jsonl"
    log.write_text(
        json.dumps({**base, "label": "busy", "loadavg_start": [7.5, 1, 1]})
        + "\n"
        + json.dumps({**base, "label": "quiet", "loadavg_start": [1.2, 1, 1]})
        + "\n"
    )
    speedrun.log_table(log)
    rows = capsys.readouterr().out.splitlines()[2:]
    assert "**noisy** (load 7.5) busy" in rows[0]
    assert "noisy" not in rows[1]


def _script(name: str):
    """bench/<name>.py as a module (the scripts are not a package)."""
    return bench_script(name, f"bench_load_test_{name}")


# Arguments that get each script past its own argument checks, with every folder it could write
# under tmp_path ("T"), so the test sees that nothing was written before the refusal.
SCRIPTS = {
    "arch": ["--cache", "T/c", "--out-dir", "T/o"],
    "arch_length": ["--out-dir", "T/o"],
    "data": [],
    "data_cuts": [],
    "data_dedup": [],
    "data_filters": [],
    "data_offsets": [],
    "data_planted": [],
    "data_scale": ["--tmp", "T"],
    "data_synth": ["T/o"],
    "checker_heads": ["spatial", "1", "--train-data", "T/ck", "--eval-data", "T/ev"],
    "ddp": ["--tiny", "--cache", "T/c", "--log", "T/log.jsonl"],
    "distill": ["T/o"],
    "distill_cpu": ["T/o", "--teacher", "T/t"],
    "distill_draft": ["T/o", "--teacher", "T/t"],
    "engine_profile": [],
    "fp8_train": ["T/o"],
    "gguf_parity": ["--model", "T/m"],
    "image": ["--work", "T/w", "--out", "T/i.json", "--grid", "T/g.png"],
    "image_tokens": ["--work", "T/w", "--out", "T/i.json", "--grid", "T/g.png"],
    "invariance": ["--out", "T/i.json"],
    "ladder": ["--cache", "T/c", "--out-dir", "T/o"],
    "lowprec": ["--model", "T/m", "--out", "T/l.json"],
    "memory": ["T/dataset"],
    "mfu": ["--smoke", "--cache", "T/c"],
    "model": [],
    "mup": ["--cache", "T/c", "--out-dir", "T/o", "--plot", "T/p.png"],
    "mup_demo": ["--cache", "T/c", "--out-dir", "T/o", "--plot", "T/p.png"],
    "posttrain": ["--sft", "T/sft", "--chat", "T/chat", "--out", "T/o"],
    "posttrain_sft": ["--demo", "T/demo", "--out", "T/o"],
    "posttrain_trl": ["--tiny", "--out", "T/o"],
    "quantize": ["--out", "T/q.json"],
    "scaling_fit": [],
    "serve": [],
    "serve_load": ["T/model"],
    "spec_engine": ["--out", "T/se.json"],
    "speculative": ["--draft", "T/draft", "--out", "T/s.json"],
    "speedrun": ["--cache", "T/c", "--log", "T/log.jsonl"],
    "switches": ["--cache", "T/c", "--out-dir", "T/o"],
    "tokenizer": [],
    "train": ["--cache", "T/c"],
}


def test_every_recording_script_is_listed() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_")}
    # attention.py and gpu.py need CUDA before they can measure; their checks are covered on a GPU
    # machine (gpu.py --dry-run on a CPU: tests/test_bench_gpu.py). quiet.py runs the others and
    # records nothing itself.
    assert scripts - {"attention", "gpu", "quiet"} == set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_refuses_a_busy_machine_before_measuring(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts prepend bench/ to it
    module = _script(name)
    monkeypatch.setattr(_load.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    argv = [a.replace("T", str(tmp_path), 1) if a.startswith("T") else a for a in SCRIPTS[name]]
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", *argv])
    takes_argv = bool(inspect.signature(module.main).parameters)
    with pytest.raises(SystemExit) as exc:
        module.main(argv) if takes_argv else module.main()
    assert str(exc.value).startswith(f"bench/{name}.py: not recording")
    assert "9.00" in str(exc.value)
    assert list(tmp_path.iterdir()) == []


def test_quiet_plan_fits_the_budget_with_reduced_settings_and_prerequisites() -> None:
    quiet = _script("quiet")
    names = ["serve_load", "posttrain"]
    steps, skipped = quiet.plan(names, None, have=set())
    # Without a budget: full settings; the demo is made once, before the first item needing it,
    # and the SFT model (made from the demo) before post-training II.
    assert [(s.item.name, s.reduced, s.prep) for s in steps] == [
        ("serve_load", False, ("demo",)),
        ("posttrain", False, ("sft",)),
    ]
    assert skipped == []
    full_posttrain = steps[1].minutes
    budget = steps[0].minutes + full_posttrain - 1
    steps, skipped = quiet.plan(names, budget, have=set())
    assert [(s.item.name, s.reduced) for s in steps] == [("serve_load", False), ("posttrain", True)]
    assert sum(s.minutes for s in steps) <= budget
    steps, skipped = quiet.plan(names, 5, have={"demo"})
    assert [s.item.name for s in steps] == ["serve_load"] and steps[0].prep == ()
    assert [n.split(" ")[0] for n in skipped] == ["posttrain"]


def test_quiet_rejects_unknown_items(capsys) -> None:
    quiet = _script("quiet")
    with pytest.raises(SystemExit):
        quiet.main(["--plan", "--only", "serve,nonsense"])
    assert "unknown item(s) nonsense" in capsys.readouterr().err


def test_quiet_step_waits_for_quiet_runs_and_logs(tmp_path: Path, monkeypatch, capsys) -> None:
    quiet = _script("quiet")
    log = quiet.Log(tmp_path / "quiet.log")
    args = argparse.Namespace(max_wait=0.0, noisy=False)
    monkeypatch.setattr(quiet.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    assert quiet.run_step("busy", [[sys.executable, "-c", "pass"]], tmp_path, log, args) == (
        "not quiet"
    )
    assert not (tmp_path / "busy.log").exists()
    monkeypatch.setattr(quiet.os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    fails = [sys.executable, "-c", "print('measured'); raise SystemExit(3)"]
    assert quiet.run_step("item", [fails], tmp_path, log, args) == "failed (exit 3)"
    assert "measured" in (tmp_path / "item.log").read_text()
    ok = [sys.executable, "-c", "print('fine')"]
    assert quiet.run_step("good", [ok, ok], tmp_path, log, args) == "ok"
    assert (tmp_path / "good.log").read_text().splitlines().count("fine") == 2  # both commands ran
    lines = (tmp_path / "quiet.log").read_text().splitlines()
    assert any("busy: skipped" in line for line in lines)
    assert any("item: FAILED (exit 3)" in line for line in lines)
    assert any("good: ok" in line for line in lines)
