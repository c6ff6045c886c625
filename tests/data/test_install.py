"""Replacing a dataset never loses one: --force replaces only kiln datasets, SIGINT/SIGTERM wait
for the two renames, and what a killed replacement left is restored or removed at the next start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import kiln.cli
from kiln.data import tokenize_shards as tokenize_module
from kiln.data.procs import interrupts_deferred, sigterm_as_interrupt
from kiln.data.tokenize_shards import install_dataset, remove_abandoned_builds
from kiln.errors import KilnError
from tests.data.conftest import write_inputs
from tests.data.test_bad_inputs_data import assert_one_clear_line

ROOT = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    """The PID of a process that has already exited."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                           capture_output=True, text=True)  # fmt: skip
    return int(child.stdout)


def _seed(root: Path) -> int:
    return json.loads((root / "manifest.json").read_text())["config"]["seed"]


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.parametrize(
    "manifest",
    ['{"name": "my web app", "icons": []}', "[]", "not json", '{"format": "kiln-other"}'],
    ids=["web-app", "list", "not-json", "other-format"],
)
def test_force_keeps_a_folder_whose_manifest_json_is_not_a_kiln_one(
    capsys, tmp_path, tiny_tokenizer_file, manifest
) -> None:
    out = tmp_path / "site"
    out.mkdir()
    (out / "manifest.json").write_text(manifest)
    (out / "precious.txt").write_text("thesis")
    inputs = [str(p) for p in write_inputs(tmp_path / "in")]
    argv = ["data", "tokenize", *inputs, "--tokenizer", str(tiny_tokenizer_file)]
    code = kiln.cli.main([*argv, "--out", str(out), "--force", "--quiet"])
    assert_one_clear_line(code, capsys.readouterr().err, "site", "not a kiln dataset")
    assert (out / "precious.txt").read_text() == "thesis"
    assert (out / "manifest.json").read_text() == manifest
    assert _hidden(tmp_path) == []


def test_interrupts_wait_for_the_end_of_the_block() -> None:
    reached = False
    with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt), interrupts_deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # bytecodes run: a handler would have fired by now
        reached = True
    assert reached


def test_a_sigterm_between_the_renames_waits_for_them(build_dataset, monkeypatch) -> None:
    root = build_dataset(seed=0)
    new = build_dataset("new", seed=1)

    def sigterm(name: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(tokenize_module, "kill_point", sigterm)
    with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt):
        install_dataset(new, root)
    assert _seed(root) == 1 and not new.exists()
    assert _hidden(root.parent) == []  # the old dataset was deleted, not left aside


def test_a_dataset_a_killed_replacement_set_aside_is_restored(build_dataset, tmp_path) -> None:
    root = build_dataset(seed=0)
    before = _files(root)
    os.replace(root, tmp_path / f".ds.{_dead_pid()}.old.tmp")  # killed between the renames
    with pytest.raises(KilnError, match="already exists; pass --force"):
        build_dataset(seed=1)  # restored first, so it is not clobbered without --force
    assert _files(root) == before
    assert _hidden(tmp_path) == []


def test_a_kill_between_the_renames_loses_nothing(build_dataset, tmp_path, tiny_tokenizer_file):
    root = build_dataset(seed=0)
    before = _files(root)
    inputs = [str(p) for p in write_inputs(tmp_path / "inputs")]
    argv = [sys.executable, "-m", "kiln.cli", "data", "tokenize", *inputs, "--tokenizer",
            str(tiny_tokenizer_file), "--out", str(root), "--seed", "1", "--val-docs", "2",
            "--force", "--quiet"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KILN_TEST_KILL_AT": "install:between-renames"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not root.exists()  # the moment the kill chose: the old dataset is set aside
    hidden = _hidden(tmp_path)  # the old dataset set aside, the new one in its build folder
    (aside,) = [name for name in hidden if name.endswith(".old.tmp")]
    (build,) = [name for name in hidden if name != aside]
    assert remove_abandoned_builds(root) == [tmp_path / build]  # the old one is moved back
    assert _files(root) == before
    assert _hidden(tmp_path) == []


def test_leftovers_of_dead_processes_are_removed_at_the_next_start(build_dataset, tmp_path) -> None:
    root = build_dataset(seed=0)
    dead, live = _dead_pid(), os.getppid()
    names = [f".ds.{dead}.old.tmp", f".ds.{dead}.work.tmp", f".ds.{dead}.k2j4_x9a.tmp"]
    keep = [f".ds.{live}.old.tmp", f".ds.{dead}.old", ".other.1.old.tmp"]
    for name in names + keep:
        (tmp_path / name).mkdir()
        (tmp_path / name / "x").write_text("leftover")
    build_dataset(seed=1, force=True)
    assert _seed(root) == 1
    assert _hidden(tmp_path) == sorted(keep)  # a live process's and other names stay
