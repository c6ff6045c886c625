"""Pipeline configs: relative paths from the TOML's folder, clear errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.data.pipeline.config import expand_sources, load_pipeline_config
from kiln.errors import KilnError


def _write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "a.txt").write_text("hello\n<|endoftext|>\n")
    (tmp_path / "data" / "b.jsonl").write_text('{"text": "hi"}\n')
    path = tmp_path / "conf" / "p.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(body)
    return path


BASE = """
[[sources]]
name = "s"
paths = ["../data/*"]
[tokenize]
tokenizer = "tok.json"
"""


def test_relative_paths_are_read_from_the_config_folder(tmp_path: Path) -> None:
    cfg = load_pipeline_config(_write(tmp_path, BASE))
    files = expand_sources(cfg)
    assert [(f.relpath, f.format) for f in files] == [("a.txt", "txt"), ("b.jsonl", "jsonl")]
    assert cfg.tokenize.tokenizer == str(tmp_path / "conf" / "tok.json")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("[[sources]]\nname='s'\npaths=['x']\n", "unique"),
        ("[split]\nval_fraction = 1.5\n", "val_fraction"),
        ("[dedup.near]\nbandz = 3\n", "dedup.near.bandz"),
        ("[quality.c4]\nenabled = 'yes'\n", "quality.c4.enabled"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(KilnError, match=message):
        load_pipeline_config(_write(tmp_path, BASE + extra))


def test_shares_must_cover_every_source_and_add_up(tmp_path: Path) -> None:
    two = BASE.replace('paths = ["../data/*"]', 'paths = ["../data/*"]\nshare = 0.6') + (
        "[[sources]]\nname = 't'\npaths = ['../data/a.txt']\nshare = 0.6\n"
    )
    with pytest.raises(KilnError, match=r"add up to 1\.2"):
        load_pipeline_config(_write(tmp_path, two))
    one = BASE.replace('paths = ["../data/*"]', 'paths = ["../data/*"]\nshare = 1.0') + (
        "[[sources]]\nname = 't'\npaths = ['../data/a.txt']\n"
    )
    with pytest.raises(KilnError, match="every source or for none"):
        load_pipeline_config(_write(tmp_path, one))


def test_a_glob_matching_nothing_is_named(tmp_path: Path) -> None:
    cfg = load_pipeline_config(_write(tmp_path, BASE.replace("../data/*", "../nope/*.txt")))
    with pytest.raises(KilnError, match=r"nope/\*\.txt matches no file"):
        expand_sources(cfg)
