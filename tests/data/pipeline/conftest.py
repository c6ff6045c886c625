"""Fixtures for the pipeline tests: the datatrove comparison harness of bench/data_filters.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def filter_bench() -> ModuleType:
    """bench/data_filters.py as a module (kiln and datatrove filters, configured alike)."""
    pytest.importorskip("datatrove")
    pytest.importorskip("nltk")
    path = Path(__file__).resolve().parents[3] / "bench" / "data_filters.py"
    spec = importlib.util.spec_from_file_location("bench_data_filters", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
