"""A missing shared data folder skips its tests, except under KILN_REQUIRE_SHARED=1 (make test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures import require_shared


def test_missing_shared_data_skips_by_default(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("KILN_REQUIRE_SHARED", raising=False)
    with pytest.raises(pytest.skip.Exception, match="shared data not found"):
        require_shared(tmp_path / "absent")
    assert require_shared(tmp_path) == tmp_path


def test_missing_shared_data_fails_when_required(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KILN_REQUIRE_SHARED", "1")
    with pytest.raises(pytest.fail.Exception, match="KILN_REQUIRE_SHARED=1"):
        require_shared(tmp_path / "absent")
    assert require_shared(tmp_path) == tmp_path
