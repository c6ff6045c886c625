"""bench/data_planted.py at its tiny size: every stage scores, datatrove runs beside it, and
Jaccard verification removes the planted false positives LSH let through."""

from __future__ import annotations

import importlib

import pytest


def test_tiny_planted_bench_runs_and_verification_removes_false_positives() -> None:
    pytest.importorskip("datatrove")
    bench = importlib.import_module("bench.data_planted")  # its dataclasses need sys.modules
    result = bench.run(bench.TINY)
    rows = {row["stage"]: row for row in result["rows"]}
    assert set(rows) >= {"classifier", "perplexity", "bad_words", "url_blocklist", "pii_phone",
                         "line_dedup", "minhash 14x8", "minhash 20x5"}  # fmt: skip
    loose = rows["minhash 20x5"]
    # LSH alone merges some planted pairs below the threshold; verification none of them.
    lsh_low = loose["kiln_lsh"]["merged_by_bin"][:2]
    verified_low = loose["kiln"]["merged_by_bin"][:2]
    assert sum(lsh_low) > 0 and verified_low == [0.0, 0.0]
    assert loose["kiln"]["precision"] == 1.0 > loose["kiln_lsh"]["precision"]
    assert loose["kiln"]["recall"] == loose["kiln_lsh"]["recall"]
    assert rows["line_dedup"]["kiln"]["recall"] == 1.0
    bloom = rows["bloom exact dedup (p = 0.01)"]["kiln"]
    assert bloom["recall"] == 1.0 and bloom["achieved_false_positive_rate"] < 0.05
    assert rows["pii_phone"]["kiln"]["recall"] == 1.0
    assert rows["pii_phone"]["datatrove"]["recall"] == 0.0  # no phone rule there
    assert "ratio" in rows["bad_words"] and "missing" in rows["classifier"]["datatrove"]
    assert "| minhash 20x5 + Jaccard 0.7 |" in bench.report(result)
