"""Speculative decoding: greedy output equals the target's, sampling keeps its distribution."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from kiln.errors import KilnError
from kiln.model import ModelConfig, Transformer
from kiln.model.generate import generate
from kiln.serve.engine import speculative
from kiln.serve.engine.speculative import (
    GREEDY,
    DraftModelDrafter,
    PromptLookupDrafter,
    SpeculativeDecoder,
    Warp,
    verify,
)
from tests.fixtures import single_torch_thread
from tests.model.helpers import randomize

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


def model(seed: int, vocab_size: int = 64, n_layer: int = 2, std: float = 0.3) -> Transformer:
    """A random tiny model with peaked next-token distributions (large random weights)."""
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny", vocab_size=vocab_size, block_size=64, n_layer=n_layer)
    return randomize(Transformer(cfg), std=std, seed=seed).eval()


class FixedDrafter:
    """Proposes the same wrong-or-right tokens every time (and counts its calls)."""

    def __init__(self, token: int) -> None:
        self.token, self.calls = token, 0

    def propose(self, context_ids: Sequence[int], k: int) -> tuple[list[int], None]:
        self.calls += 1
        return [self.token] * k, None


PROMPT = [3, 17, 5, 3, 17, 9, 3, 17]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("drafter_name", ["lookup", "draft-greedy", "draft-sampled", "fixed"])
def test_greedy_output_equals_target_only_decoding(k: int, drafter_name: str) -> None:
    target = model(0)
    drafters = {
        "lookup": PromptLookupDrafter(),
        "draft-greedy": DraftModelDrafter(model(1, n_layer=1)),
        "draft-sampled": DraftModelDrafter(model(1, n_layer=1), Warp(1.0), seed=0),
        "fixed": FixedDrafter(7),
    }
    decoder = SpeculativeDecoder(target, drafters[drafter_name], k)
    want = generate(target, [PROMPT], 40, temperature=0)[0]
    assert decoder.generate(PROMPT, 40, GREEDY) == want
    stats = decoder.stats
    assert stats.generated == 40 and stats.accepted <= stats.drafted
    assert stats.target_forwards == 40 - stats.accepted  # each forward yields accepted + 1


def test_a_perfect_drafter_is_always_accepted_and_a_wrong_one_never() -> None:
    target = model(0)
    same = SpeculativeDecoder(target, DraftModelDrafter(target), k=4)
    want = generate(target, [PROMPT], 21, temperature=0)[0]
    assert same.generate(PROMPT, 21, GREEDY) == want
    assert same.stats.acceptance_rate == 1.0
    assert same.stats.target_forwards == 5  # 4 + 1 tokens per forward, the last step shortened
    wrong_token = next(t for t in range(64) if t not in want)
    wrong = SpeculativeDecoder(target, FixedDrafter(wrong_token), k=4)
    assert wrong.generate(PROMPT, 21, GREEDY) == want
    assert wrong.stats.acceptance_rate == 0.0 and wrong.stats.target_forwards == 21


def test_drafts_are_cut_to_fit_max_tokens_and_the_block_size() -> None:
    target = model(0)
    prompt = (PROMPT * 8)[:57]  # 57 + 7 new = the block size 64
    decoder = SpeculativeDecoder(target, DraftModelDrafter(target), k=8)
    want = generate(target, [prompt], 7, temperature=0)[0]
    assert decoder.generate(prompt, 7, GREEDY) == want
    assert decoder.stats.drafted == 6 and decoder.stats.target_forwards == 1


def test_stop_tokens_end_the_output_where_target_decoding_stops() -> None:
    target = model(0)
    free = generate(target, [PROMPT], 30, temperature=0)[0]
    stop = free[12]
    want = generate(target, [PROMPT], 30, temperature=0, stop_tokens=[stop])[0]
    decoder = SpeculativeDecoder(target, DraftModelDrafter(target), k=5)  # stop inside drafts
    assert decoder.generate(PROMPT, 30, GREEDY, stop_tokens=[stop]) == want
    assert len(want) < 13


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    lookup = PromptLookupDrafter(max_ngram=2)
    assert lookup.propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 3) == ([5, 6, 1], None)
    assert lookup.propose([1, 2, 3, 9, 2], 2) == ([3, 9], None)  # 1-gram after no 2-gram
    assert lookup.propose([1, 2, 3], 4) == ([], None)
    with pytest.raises(KilnError, match="min_ngram <= max_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


def test_the_draft_model_rolls_its_cache_back_to_each_new_context() -> None:
    draft = model(1, n_layer=1)
    drafter = DraftModelDrafter(draft)
    first, _ = drafter.propose(PROMPT, 4)
    assert first == generate(draft, [PROMPT], 4, temperature=0)[0]
    # The target kept one draft and chose another token: the drafter continues from there.
    context = [*PROMPT, first[0], (first[1] + 1) % 64]
    again, probs = drafter.propose(context, 3)
    assert again == generate(draft, [context], 3, temperature=0)[0] and probs is None
    sampled = DraftModelDrafter(draft, Warp(1.0), seed=0)
    ids, probs = sampled.propose(PROMPT, 3)
    assert probs is not None and probs.shape == (3, 64)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(3))
    assert all(float(probs[i, t]) > 0 for i, t in enumerate(ids))  # drawn from those rows


def test_bad_settings_are_clear_errors() -> None:
    target = model(0)
    with pytest.raises(KilnError, match="k must be >= 1"):
        SpeculativeDecoder(target, PromptLookupDrafter(), k=0)
    with pytest.raises(KilnError, match=r"vocabulary \(32\) differs from the target's \(64\)"):
        SpeculativeDecoder(target, DraftModelDrafter(model(1, vocab_size=32)))
    decoder = SpeculativeDecoder(target, PromptLookupDrafter())
    with pytest.raises(KilnError, match="exceeds the model's block_size 64"):
        decoder.generate(PROMPT, 60)


def chi_square_p_value(counts: Counter[int], probs: dict[int, float], n: int) -> float:
    """Pearson's chi-square test of observed counts against exact probabilities.

    Cells expected fewer than 5 times are pooled into one, as the test's approximation needs.
    """
    observed, expected = [], []
    pooled_obs = pooled_exp = 0.0
    for cell, p in probs.items():
        if p * n < 5:
            pooled_obs, pooled_exp = pooled_obs + counts[cell], pooled_exp + p * n
        else:
            observed.append(counts[cell])
            expected.append(p * n)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = len(observed) - 1
    # The chi-square survival function: the regularised upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def rule_samples(n: int, seed: int = 0) -> tuple[Counter[int], dict[int, float]]:
    """First output tokens of the rule over 2 drafts from q, with target p, n times."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.07, 0.03]] * 3)  # (m+1, V): target
    q = torch.tensor([[0.05, 0.10, 0.15, 0.20, 0.20, 0.30]] * 2)  # (m, V): far from p
    counts: Counter[int] = Counter()
    for _ in range(n):
        drafts = torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
        accepted, nxt = verify(p, drafts, q, gen)
        counts[drafts[0] if accepted else nxt] += 1
    return counts, dict(enumerate(p[0].tolist()))


def test_the_accept_reject_rule_keeps_the_target_distribution() -> None:
    counts, probs = rule_samples(6000)
    assert chi_square_p_value(counts, probs, 6000) > 1e-3


def test_the_chi_square_check_catches_a_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    # After a rejection, drawing from p itself (not the residual) over-weights the drafts.
    monkeypatch.setattr(speculative, "residual_distribution", lambda p, q: p)
    counts, probs = rule_samples(6000)
    assert chi_square_p_value(counts, probs, 6000) < 1e-6


@torch.inference_mode()
def exact_two_token_distribution(target: Transformer, prompt: list[int], warp: Warp):
    """The target's exact probability of every pair of first two new tokens."""
    first = warp.probs(target(torch.tensor([prompt]))[0, -1])  # (V,)
    V = first.numel()
    rows = torch.tensor([[*prompt, a] for a in range(V)])  # (V, T+1)
    second = warp.probs(target(rows)[:, -1])  # (V, V): p(b | prompt, a)
    joint = first[:, None] * second
    return {(a, b): float(joint[a, b]) for a, b in itertools.product(range(V), range(V))}


@pytest.mark.parametrize(("drafter_name", "min_accepted"), [("draft-model", 0.5), ("lookup", 0.02)])
def test_sampled_output_has_the_target_distribution(drafter_name: str, min_accepted: float) -> None:
    """End to end on a 6-token vocabulary: the first two tokens' joint law, chi-square."""
    target = model(0, vocab_size=6, n_layer=1, std=0.1)
    warp = Warp(temperature=1.0, top_k=5)
    prompt = [1, 2, 3, 1, 2]
    probs = exact_two_token_distribution(target, prompt, warp)
    if drafter_name == "draft-model":  # the target itself, cooler: q close to p, not equal
        drafter = DraftModelDrafter(target, Warp(0.6, top_k=5), seed=0)
    else:
        drafter = PromptLookupDrafter()
    decoder = SpeculativeDecoder(target, drafter, k=2)
    n = 800
    counts: Counter[tuple[int, int]] = Counter()
    for seed in range(n):
        out = decoder.generate(prompt, 3, warp, seed=seed)  # k=2 drafts
        counts[(out[0], out[1])] += 1
    stats = decoder.stats
    assert min_accepted * stats.drafted < stats.accepted < stats.drafted  # kept and rejected
    assert chi_square_p_value(counts, probs, n) > 1e-3
