"""The end-of-text token inside a `.txt` document is text, not a cut, in `kiln data tokenize`
and `kiln data run`: only a line holding the separator alone ends a document."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

import kiln.cli
from kiln.data.pipeline.read.readers import INLINE_SEPARATOR
from kiln.data.shard_reader import Dataset
from kiln.tokenizer.formats import read_any
from tests.data.conftest import EOT

INJECTED = f"The apple fell from the tree. INJECT{EOT}ED The cherry was red."


def _assert_eot_only_at_ends(ds: Dataset) -> int:
    """Every document ends with end-of-text and holds it nowhere else; returns the count."""
    n = 0
    for split in ds.splits.values():
        for i in range(split.n_documents):
            doc = np.asarray(split.document(i))
            assert doc[-1] == ds.eot_id
            assert not (doc[:-1] == ds.eot_id).any(), f"end-of-text inside document {i}"
            n += 1
    return n


def test_tokenize_keeps_an_inline_separator_as_text(capsys, tmp_path, tiny_tokenizer_file) -> None:
    src = tmp_path / "in.txt"
    src.write_text(f"{INJECTED}\n{EOT}\nSecond document.\n  {EOT}  \nThird.\n", encoding="utf-8")
    out = tmp_path / "ds"
    argv = ["data", "tokenize", "--tokenizer", str(tiny_tokenizer_file), str(src)]
    assert kiln.cli.main([*argv, "--out", str(out), "--val-docs", "0", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"1 {EOT} inside documents" in err and str(src) in err
    ds = Dataset.open(out)
    assert _assert_eot_only_at_ends(ds) == 3
    assert ds.manifest.sources[0].inline_separators == 1
    tok = read_any(tiny_tokenizer_file)
    first = ds.split("train").document(0)[:-1].tolist()
    assert tok.decode(first) == INJECTED  # the literal text, as ordinary bytes


def test_data_run_keeps_an_inline_separator_as_text(shared_data: Path, tmp_path: Path) -> None:
    with gzip.open(shared_data / "tinystories" / "valid.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read(60_000)
    stories = [s.strip() for s in text.split(EOT) if len(s.split()) > 80][:12]
    half = len(stories[4]) // 2
    stories[4] = f"{stories[4][:half]} INJECT{EOT}ED {stories[4][half:]}"
    (tmp_path / "s.txt").write_text("".join(f"{s}\n{EOT}\n" for s in stories), encoding="utf-8")
    config = tmp_path / "p.toml"
    config.write_text(
        f'[[sources]]\nname = "s"\npaths = ["{tmp_path / "s.txt"}"]\n'
        f'[tokenize]\ntokenizer = "{shared_data}/gpt2/vocab.json"\n',
        encoding="utf-8",
    )
    out = tmp_path / "out"
    argv = ["data", "run", str(config), "--out", str(out), "--workers", "1", "--quiet"]
    assert kiln.cli.main(argv) == 0
    ds = Dataset.open(out)
    funnel = ds.manifest.pipeline["funnel"]
    assert funnel[0]["stage"] == "read" and funnel[0]["kept"] == len(stories)
    _assert_eot_only_at_ends(ds)
    stats = json.loads((out / "pipeline" / "stats.json").read_text())
    assert stats["read_issues"]["counts"][INLINE_SEPARATOR] == 1
    tok = read_any(shared_data / "gpt2" / "vocab.json")
    texts = [
        tok.decode(split.document(i)[:-1].tolist())
        for split in ds.splits.values()
        for i in range(split.n_documents)
    ]
    assert any(f"INJECT{EOT}ED" in t for t in texts)
