"""Scoring: batched, padded log-probs equal direct one-sequence computations; windows are exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import KilnError
from kiln.eval import scoring
from kiln.eval.scoring import Scorer, encode_pair, request_windows, rolling_windows
from kiln.model.transformer import Transformer
from kiln.tokenizer import Tokenizer

from .conftest import random_tiny


def direct_logprobs(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1, from one unpadded forward (the reference)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]]))[0].double()  # (T, V)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def direct_with_context(model: Transformer, tokens: list[int], context: int) -> float:
    """Sum over targets i >= 1 of log p(tokens[i] | the `context` tokens before it, or all)."""
    return sum(
        float(direct_logprobs(model, tokens[max(0, i - context) : i + 1])[-1])
        for i in range(1, len(tokens))
    )


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 300), block=st.integers(1, 40), data=st.data())
def test_rolling_windows_score_every_token_once_with_enough_context(
    n: int, block: int, data: st.DataObject
) -> None:
    stride = data.draw(st.integers(1, block))
    scored: list[int] = []
    for lo, hi, n_scored in rolling_windows(n, block, stride):
        assert hi - lo - 1 <= block  # the inputs fit the model
        assert 1 <= n_scored <= min(stride, hi - lo - 1)
        targets = range(hi - n_scored, hi)
        for p in targets:  # each target sees min(p, block + 1 - stride) tokens or more
            assert p - lo >= min(p, block + 1 - stride)
        scored.extend(targets)
    assert scored == list(range(1, n))


def test_rolling_windows_reject_a_bad_stride() -> None:
    with pytest.raises(KilnError, match=r"stride must be in 1..block_size \(8\), got 9"):
        rolling_windows(100, 8, 9)


@pytest.mark.parametrize("head_rows", [None, 3])
def test_batched_padded_scores_equal_direct_ones(
    tiny: Transformer, head_rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if head_rows is not None:  # the LM head over a few target rows at a time
        monkeypatch.setattr(scoring, "LOGIT_CHUNK_ELEMENTS", head_rows * tiny.cfg.vocab_size)
    gen = torch.Generator().manual_seed(1)
    windows = []
    for length in (2, 129, 40, 7, 129, 3, 60):
        tokens = torch.randint(0, 400, (length,), generator=gen).tolist()
        windows.append((tokens, min(length - 1, 5 + length // 3)))
    expected = [float(direct_logprobs(tiny, t)[-n:].sum()) for t, n in windows]
    for batch_size in (1, 3, 16):
        got = Scorer(tiny, batch_size, progress=False).score_windows(windows)
        assert [s.n_tokens for s in got] == [n for _, n in windows]
        assert [s.logprob for s in got] == pytest.approx(expected, abs=1e-4)


def test_greedy_flag_is_the_argmax_of_every_target(tiny: Transformer) -> None:
    prompt = [5, 17, 33]
    with torch.no_grad():
        following = []
        tokens = list(prompt)
        for _ in range(4):  # the model's own greedy continuation
            tokens.append(int(tiny(torch.tensor([tokens]))[0, -1].argmax()))
        following = tokens[len(prompt) :]
    other = (following[-1] + 1) % 400
    scorer = Scorer(tiny, progress=False)
    greedy, not_greedy = scorer.score_requests(
        [(prompt, following), (prompt, [*following[:-1], other])]
    )
    assert greedy.is_greedy and not not_greedy.is_greedy


def test_long_contexts_are_cut_from_the_left(tiny: Transformer) -> None:
    context, continuation = list(range(1, 300)), [7, 8, 9]
    (scored,) = Scorer(tiny, progress=False).score_requests([(context, continuation)])
    kept = [*context, *continuation][-129:]  # block size 128: 128 inputs predict 128 targets
    assert scored.logprob == pytest.approx(float(direct_logprobs(tiny, kept)[-3:].sum()), abs=1e-4)


def test_a_continuation_longer_than_the_block_is_scored_in_chunks() -> None:
    model = random_tiny(block_size=16)
    context, continuation = list(range(1, 30)), list(range(100, 140))  # 40 > 16 targets
    windows = request_windows(context, continuation, 16)
    assert [n for _, n in windows] == [8, 16, 16]
    assert all(len(t) == 17 for t, _ in windows)  # each with a full block of inputs
    (scored,) = Scorer(model, progress=False).score_requests([(context, continuation)])
    assert scored.n_tokens == 40
    tokens = context + continuation
    expected = sum(  # target i is predicted from the 16 tokens before it's window's end
        float(direct_logprobs(model, tokens[end - 17 : end])[-n:].sum())
        for end, n in ((len(tokens) - 32, 8), (len(tokens) - 16, 16), (len(tokens), 16))
    )
    assert scored.logprob == pytest.approx(expected, abs=1e-4)


def test_documents_with_stride_one_get_the_full_sliding_context() -> None:
    model = random_tiny(block_size=16)
    doc = torch.randint(0, 400, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    (scored,) = Scorer(model, 8, progress=False).score_documents([doc], stride=1)
    assert scored.n_tokens == 49
    assert scored.logprob == pytest.approx(direct_with_context(model, doc, 16), abs=1e-4)


def test_documents_with_stride_block_are_chunked_scoring() -> None:
    model = random_tiny(block_size=16)
    doc = torch.randint(0, 400, (65,), generator=torch.Generator().manual_seed(4)).tolist()
    (scored,) = Scorer(model, 8, progress=False).score_documents([doc], stride=16)
    # 64 targets in 4 disjoint chunks of 16, each window 17 tokens sharing one boundary token.
    chunked = sum(float(direct_logprobs(model, doc[i : i + 17]).sum()) for i in range(0, 64, 16))
    assert scored.n_tokens == 64
    assert scored.logprob == pytest.approx(chunked, abs=1e-4)
    # A length that leaves a partial chunk: the last window reaches back a full block.
    (partial,) = Scorer(model, 8, progress=False).score_documents([doc[:60]], stride=16)
    head = sum(float(direct_logprobs(model, doc[i : i + 17]).sum()) for i in range(0, 48, 16))
    tail = float(direct_logprobs(model, doc[43:60])[-11:].sum())
    assert partial.n_tokens == 59
    assert partial.logprob == pytest.approx(head + tail, abs=1e-4)


def test_encode_pair_gives_the_space_to_the_continuation(tok: Tokenizer) -> None:
    context_ids, continuation_ids = encode_pair(
        tok, "The dog ran ", "home.", tok.special_tokens["<|endoftext|>"]
    )
    assert tok.decode(context_ids) == "The dog ran"
    assert tok.decode(continuation_ids) == " home."
    assert context_ids + continuation_ids == tok.encode_ordinary("The dog ran home.")


def test_an_empty_context_conditions_on_end_of_text(tok: Tokenizer) -> None:
    assert encode_pair(tok, "", " the end", 399) == ([399], tok.encode_ordinary(" the end"))
    with pytest.raises(KilnError, match="empty context needs an end-of-text token"):
        encode_pair(tok, "", " the end", None)


def test_batch_size_must_be_positive(tiny: Transformer) -> None:
    with pytest.raises(KilnError, match="batch size must be >= 1, got 0"):
        Scorer(tiny, 0)
