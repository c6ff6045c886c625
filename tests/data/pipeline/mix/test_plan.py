"""Mixing reaches each source's token target within one document, deterministically."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.data.pipeline.mix.plan import SourceMix, plan_mixture, repeats_for


def _source(name: str, lengths: list[int], share: float | None = None, rate=None) -> SourceMix:
    rng = np.random.default_rng(len(lengths))
    return SourceMix(name, share, rate, rng.random(len(lengths)), np.array(lengths, np.int64))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 500), min_size=1, max_size=60),
    st.floats(0.0, 5.0, allow_nan=False),
)
def test_repeats_reach_the_target_within_one_document(lengths: list[int], rate: float) -> None:
    source = _source("s", lengths, rate=rate)
    target = rate * sum(lengths)
    repeats = repeats_for(source, target)
    got = int((repeats * source.lengths).sum())
    assert target - 1e-6 <= got <= target + max(lengths)
    assert repeats.min() >= np.floor(target / sum(lengths))  # whole copies for everyone
    assert repeats.max() - repeats.min() <= 1
    assert np.array_equal(repeats, repeats_for(source, target))  # deterministic


def test_shares_are_met_by_down_and_up_sampling() -> None:
    big = _source("big", [100] * 90, share=0.5)  # 9,000 tokens available
    small = _source("small", [100] * 10, share=0.5)  # 1,000 tokens available
    repeats, summary = plan_mixture([big, small])
    assert summary["big"]["tokens_after"] == 5000 and summary["small"]["tokens_after"] == 5000
    assert set(repeats["big"].tolist()) == {0, 1}  # downsampled: a subset, once each
    assert set(repeats["small"].tolist()) == {5}  # upsampled: every document five times
    assert summary["small"]["share_before"] == 0.1 and summary["small"]["share_after"] == 0.5


def test_rates_scale_each_source_on_its_own() -> None:
    a = _source("a", [10] * 20, rate=0.5)
    b = _source("b", [10] * 20)  # no share, no rate: as is
    _, summary = plan_mixture([a, b])
    assert summary["a"]["tokens_after"] == 100 and summary["b"]["tokens_after"] == 200


def test_an_empty_source_contributes_nothing() -> None:
    repeats, summary = plan_mixture([_source("a", [], share=0.5), _source("b", [5], share=0.5)])
    assert repeats["a"].shape == (0,) and summary["a"]["tokens_after"] == 0
    # The other source takes all the tokens there are (its share of the total: half of 5 is
    # reached within one document), and the shares after count only what exists.
    assert repeats["b"].tolist() == [1] and summary["b"]["tokens_after"] == 5
    assert summary["b"]["share_after"] == 1.0 and summary["a"]["share_after"] == 0.0
