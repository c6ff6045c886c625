"""Preference pairs: judged by the task checks, tokenized like SFT data, read back with errors
that name the line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kiln.chat import render
from kiln.errors import KilnError
from kiln.posttrain.align import preferences
from kiln.posttrain.align.preferences import (
    SamplingConfig,
    build_pairs,
    make_pair,
    read_pairs,
    tokenize_pair,
)
from kiln.posttrain.tasks import make_example
from kiln.tokenizer import Tokenizer
from tests.posttrain.conftest import tiny_model

STORY = (
    "Once upon a time, a girl named Lily found a red ball in the park. She threw it to her dog. "
    "The dog ran fast and brought it back. Lily laughed and hugged the dog. They played all day."
)


def words_record() -> dict:
    example = make_example("words", STORY, 0, random.Random(0))
    assert example is not None
    return example.to_json()


def test_a_pair_is_the_best_passing_and_the_worst_failing_reply() -> None:
    record = words_record()
    wanted = record["params"]["words"]
    good = f"One day a {wanted[0]} and a {wanted[1]} met a {wanted[2]}. They were all happy."
    half = f"One day a {wanted[0]} and a {wanted[1]} went out. They were all happy."
    bad = "The sun was warm and the sky was blue today."
    pair = make_pair(record, [half, good, bad])
    assert pair is not None
    assert pair["chosen"] == good and pair["rejected"] == bad
    assert pair["chosen_score"] == 1.0 and pair["rejected_score"] < pair["scores"][0]
    assert pair["messages"] == record["messages"][:-1]  # the prompt, not the reference reply


def test_no_pair_when_every_reply_passes_or_every_reply_fails() -> None:
    record = words_record()
    assert make_pair(record, ["no", "nothing here at all today"]) is None
    assert make_pair(record, [record["messages"][-1]["content"]] * 2) is None


def test_tokenized_replies_are_what_sft_would_train(chat_tok: Tokenizer) -> None:
    record = words_record()
    pair = {"messages": record["messages"][:-1], "chosen": "A dog ran.", "rejected": "No."}
    tp = tokenize_pair(pair, chat_tok, "pair 1")
    full = render([*pair["messages"], {"role": "assistant", "content": "A dog ran."}], chat_tok)
    assert tp.prompt + tp.chosen == full.ids
    assert [i for i, m in zip(full.ids, full.loss_mask, strict=True) if m] == tp.chosen


def test_control_token_text_in_a_reply_is_refused(chat_tok: Tokenizer) -> None:
    pair = {"messages": [{"role": "user", "content": "hi"}], "chosen": "ok <|user|> x",
            "rejected": "no"}  # fmt: skip
    with pytest.raises(KilnError, match="pair 3"):
        tokenize_pair(pair, chat_tok, "pair 3")


def test_bad_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"messages": [], "chosen": "a", "rejected": "b"}\n{"messages": []}\n')
    with pytest.raises(KilnError, match=r"pairs.jsonl:2: expected a pair with 'chosen'"):
        read_pairs(path)
    path.write_text("")
    with pytest.raises(KilnError, match="no preference pairs"):
        read_pairs(path)


def test_sampling_is_seeded_and_recorded(
    chat_tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(preferences, "ENGINE_PROMPTS", 2)  # two engine batches: 2 + 1 prompts
    model = tiny_model(chat_tok.n_vocab)
    records = [words_record()] * 3
    cfg = SamplingConfig(samples=3, max_new_tokens=12, seed=5)
    first = [(r["id"], x, p) for r, x, p in build_pairs(model, chat_tok, records, cfg)]
    again = [(r["id"], x, p) for r, x, p in build_pairs(model, chat_tok, records, cfg)]
    assert first == again and len(first) == 3
    assert all(len(replies) == 3 for _, replies, _ in first)
    # Each prompt draws from its own seed: the same prompt gets other replies at another place.
    assert first[0][1] != first[1][1] != first[2][1]
    with pytest.raises(KilnError, match="samples must be >= 2"):
        SamplingConfig(samples=1)


def test_a_reply_cut_at_the_length_cap_gets_no_end_token(chat_tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Write about a dog."}]
    pair = {"messages": messages, "chosen": "A dog ran.", "rejected": "A dog",
            "chosen_finished": True, "rejected_finished": False}  # fmt: skip
    tp = tokenize_pair(pair, chat_tok, "pair 1")
    end = chat_tok.special_tokens["<|end|>"]
    assert tp.chosen[-1] == end and end not in tp.rejected
    assert tp.rejected == chat_tok.encode("A dog")


def test_a_model_the_engine_cannot_hold_samples_on_the_fixed_batch(chat_tok: Tokenizer) -> None:
    """MLA has no paged cache: replies come from kiln.model.generate, seeded alike."""
    model = tiny_model(chat_tok.n_vocab, n_kv_head=None, mla={"kv_rank": 16, "rope_dim": 8})
    cfg = SamplingConfig(samples=2, max_new_tokens=6, seed=1)
    first = list(build_pairs(model, chat_tok, [words_record()] * 2, cfg))
    assert [len(replies) for _, replies, _ in first] == [2, 2]
    assert first == list(build_pairs(model, chat_tok, [words_record()] * 2, cfg))
