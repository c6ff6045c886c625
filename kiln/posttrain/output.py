"""A post-training command's output folder: written beside its final name, then renamed.

OUT never holds half an output: the files go into `.OUT.tmp-PID`, which becomes OUT only when
all were written. An existing OUT is replaced only under --force and only when it holds the
marker file that says this command wrote it (never a user's unrelated folder).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from kiln.folders import abandoned_by, check_can_replace_dir, remove_dir, remove_entry


def check_output_folder(out: Path, force: bool, marker: str) -> None:
    """Refuse OUT unless it is missing, empty, or (with `force`) an earlier output with `marker`."""
    check_can_replace_dir(out, force, lambda p: (p / marker).is_file(), f"a folder with {marker}")


@contextlib.contextmanager
def output_folder(out: Path, force: bool, marker: str) -> Iterator[Path]:
    """Yield a temporary folder to write OUT's files into; it becomes OUT on success."""
    check_output_folder(out, force, marker)
    for left in out.parent.glob(f".{out.name}.tmp-*"):  # a killed earlier run's half output
        pid = left.name.rpartition("-")[2]
        if pid.isdigit() and abandoned_by(int(pid)):
            remove_entry(left)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.is_dir() and any(out.iterdir()):
            remove_dir(out)  # allowed above: --force over an earlier output of this command
        elif out.is_dir():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
