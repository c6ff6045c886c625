"""The sampler: truncation, penalties, greedy, reproducible generators."""

from __future__ import annotations

import torch

from kiln.serve.engine.sampling import (
    SamplingParams,
    apply_penalties,
    sample_generator,
    sample_token,
    truncate,
)


def test_top_k_top_p_min_p_keep_only_the_allowed_tokens() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    keep = lambda **kw: torch.isfinite(truncate(logits, SamplingParams(**kw))).tolist()  # noqa: E731
    assert keep(top_k=2) == [True, True, False, False, False]
    probs = logits.softmax(-1)  # ~[.64, .24, .09, .03, .01]
    assert probs[0] < 0.7 < probs[:2].sum()
    assert keep(top_p=0.7) == [True, True, False, False, False]
    assert keep(top_p=0.5) == [True, False, False, False, False]
    assert keep(min_p=0.1) == [True, True, True, False, False]  # p >= 0.064


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0], [1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied
    pf = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, pf, [3], [2, 2, 0])
    assert out.tolist() == [2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5]  # generated tokens only


def test_greedy_takes_the_argmax_and_seeds_reproduce() -> None:
    logits = torch.randn(50)
    greedy = sample_token(logits, SamplingParams(temperature=0), [], [], torch.Generator())
    assert greedy.token_id == int(logits.argmax())
    params = SamplingParams(seed=7)

    def draws(index: int) -> list[int]:
        g = sample_generator(params, index, torch.device("cpu"))
        return [sample_token(logits, params, [], [], g).token_id for _ in range(20)]

    assert draws(0) == draws(0)
    assert draws(0) != draws(1)


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = torch.randn(30)
    g = torch.Generator().manual_seed(0)
    picks = {sample_token(logits, SamplingParams(top_k=1, temperature=5.0), [], [], g).token_id
             for _ in range(10)}  # fmt: skip
    assert picks == {int(logits.argmax())}
