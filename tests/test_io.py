"""Atomic writes: all or nothing, ordinary permissions, no clobbering without force."""

from __future__ import annotations

import os
import stat

import pytest

from kiln.errors import KilnError
from kiln.io import atomic_write, check_can_write, open_binary


def test_atomic_write_leaves_nothing_on_failure(tmp_path) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_write(target) as handle:
        handle.write("partial")
        raise RuntimeError("boom")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.json"]


def test_atomic_write_uses_umask_permissions(tmp_path) -> None:
    target = tmp_path / "out.txt"
    with atomic_write(target) as handle:
        handle.write("x")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask


def test_refuses_to_clobber_without_force(tmp_path) -> None:
    target = tmp_path / "a"
    target.write_text("x")
    with pytest.raises(KilnError, match="--force"):
        check_can_write(target, force=False)
    check_can_write(target, force=True)


def test_open_binary_errors_name_the_path(tmp_path) -> None:
    with pytest.raises(KilnError, match=r"missing\.txt: no such file"):
        open_binary(tmp_path / "missing.txt")
    with pytest.raises(KilnError, match="is a directory"):
        open_binary(tmp_path)


def test_jsonl_errors_name_file_and_line(tmp_path) -> None:
    from kiln.io import iter_jsonl_texts

    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "bad \xff"}\n')
    with pytest.raises(KilnError, match=r"d\.jsonl:2: invalid UTF-8"):
        list(iter_jsonl_texts(path))
    path.write_bytes(b'{"text": "ok"}\n\n{"body": "x"}\n')
    with pytest.raises(KilnError, match=r"d\.jsonl:3: expected an object with a 'text' field"):
        list(iter_jsonl_texts(path))
    path.write_bytes(b'{"text": 3}\n')
    with pytest.raises(KilnError, match=r"d\.jsonl:1: field 'text' must be a string"):
        list(iter_jsonl_texts(path))
    path.write_bytes(b"{not json\n")
    with pytest.raises(KilnError, match=r"d\.jsonl:1: invalid JSON"):
        list(iter_jsonl_texts(path))
