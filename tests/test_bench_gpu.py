"""bench/gpu.py --dry-run: every entry's path checked on the CPU, one JSON line each, exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_checks_every_entry_and_exits_0() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    sys.path.insert(0, str(ROOT))
    from bench.gpu import ENTRIES

    assert [r["entry"] for r in lines] == [e.name for e in ENTRIES]
    assert all(r["ok"] for r in lines)
    mfu = {r["entry"]: r for r in lines}
    assert 120e6 < mfu["mfu_bf16"]["params"] < 130e6
    assert mfu["mfu_fp8_tensor"]["cuda_backend"] == "scaled_mm"
    assert mfu["mfu_fp8_tensor"]["fp8_layers"] == 48  # 4 linear layers × 12 blocks, head kept


def test_a_broken_path_fails_the_dry_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sys.path.insert(0, str(ROOT))
    from bench import gpu

    def broken(args: object) -> dict[str, object]:
        raise ValueError("no such kernel")

    monkeypatch.setattr(gpu, "ENTRIES", [gpu.Entry("broken", "a test", broken, lambda a: [])])
    assert gpu.main(["--dry-run"]) == 1
    line = json.loads(capsys.readouterr().out)
    assert line == {**line, "entry": "broken", "ok": False, "error": "ValueError: no such kernel"}
