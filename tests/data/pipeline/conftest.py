"""Fixtures for the pipeline tests: the datatrove comparison harness of bench/data_filters.py,
a small stories pipeline, and filler words no filter rule reads as English."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from kiln.tokenizer.special import EOT


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py as a module."""
    path = Path(__file__).resolve().parents[3] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def filter_bench() -> ModuleType:
    """bench/data_filters.py as a module (kiln and datatrove filters, configured alike)."""
    pytest.importorskip("datatrove")
    pytest.importorskip("nltk")
    return bench_module("data_filters")


# Eight lines of plain English prose (130 words), every line one sentence: passes every filter.
CLEAN_PROSE = """\
The history of the river town begins with a small ferry that carried farmers across the water.
Over many years the crossing grew into a market where traders sold grain, wool and timber.
A stone bridge replaced the ferry in the spring of a wet year, and the market moved closer to it.
Merchants built tall houses along the bank, and their children learned to swim in the shallows.
When the railway arrived, the old warehouses emptied and the quiet streets filled with visitors.
Today the bridge still stands, although cars have taken the place of carts and horses.
Local historians collect letters, maps and photographs that show how daily life has changed.
Anyone who walks along the bank at dusk can still picture the boats that once crowded there."""


def write_stories_pipeline(shared_data: Path, folder: Path) -> Path:
    """`folder/p.toml`: ~300 kB of TinyStories in tasks of 2 documents, GPT-2 tokens; its path."""
    with gzip.open(shared_data / "tinystories" / "train.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read(300_000)
    (folder / "stories.txt").write_text(text[: text.rfind(EOT)], encoding="utf-8")
    config = folder / "p.toml"
    config.write_text(
        f"""
docs_per_task = 2
[[sources]]
name = "stories"
paths = ["stories.txt"]
[tokenize]
tokenizer = "{shared_data}/gpt2/vocab.json"
""",
        encoding="utf-8",
    )
    return config


def filler_words(n: int, start: int = 0) -> list[str]:
    """n distinct four-letter consonant words (never a stop word, never an English n-gram)."""
    letters = "bcdfghjklmnpqrstvwxz"
    out = []
    for i in range(start, start + n):
        digits = []
        for _ in range(4):
            i, r = divmod(i, len(letters))
            digits.append(letters[r])
        out.append("".join(reversed(digits)))
    return out
