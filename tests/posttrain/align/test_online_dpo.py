"""Online DPO re-makes its pairs from the current policy's replies, judged by the task checks,
and a run resumed mid-round trains on the very pairs an uninterrupted one did."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.loading import load_model
from kiln.posttrain.align.dpo import DPOConfig, TokenPair
from kiln.posttrain.align.online_dpo import OnlineDPOTrainer
from kiln.posttrain.tasks import check

# "continue" with no keywords: a reply passes when it has five words or more and does not repeat
# the start, so a random model's short and long replies make pairs.
RECORDS = [
    {"id": f"c{i}", "task": "continue", "params": {"start": "Zq zq.", "keywords": []},
     "messages": [{"role": "user", "content": f"Continue this story: tale {i}"},
                  {"role": "assistant", "content": "x"}]}
    for i in range(12)
]  # fmt: skip


def trainer(out: Path, chat_run: Path, steps: int) -> OnlineDPOTrainer:
    loaded = load_model(chat_run, dtype="fp32")
    assert loaded.tokenizer is not None
    cfg = DPOConfig(steps=steps, pairs_per_step=4, lr=1e-3, warmup_steps=0, save_every=1,
                    resample_every=2, resample_prompts=12, resample_samples=6,
                    resample_temperature=1.5, resample_max_new_tokens=24, rpo_alpha=0.5)  # fmt: skip
    seed = [TokenPair([1, 2], [3], [4])]
    return OnlineDPOTrainer(loaded.model.train(), seed, cfg, out, records=RECORDS,
                            tokenizer=loaded.tokenizer)  # fmt: skip


def test_pairs_come_from_the_policy_and_resume_reads_them(tmp_path: Path, chat_run: Path) -> None:
    whole = trainer(tmp_path / "whole", chat_run, steps=4)
    records = whole.run()
    assert [r.get("online_pairs") is not None for r in records] == [True, False, True, False]
    assert records[0]["online_pairs"] > 0, "the random policy's replies made no pair"
    tok = whole.tokenizer
    special = set(tok.special_tokens.values())
    for pair in whole.pairs:  # judged by the check: the chosen reply passes, the rejected fails
        text = {side: tok.decode([t for t in ids if t not in special])
                for side, ids in (("chosen", pair.chosen), ("rejected", pair.rejected))}  # fmt: skip
        assert check(RECORDS[0], text["chosen"]) and not check(RECORDS[0], text["rejected"])
    assert whole.pairs != [TokenPair([1, 2], [3], [4])]

    part = trainer(tmp_path / "part", chat_run, steps=3)
    part.run()
    resumed = trainer(tmp_path / "part", chat_run, steps=4)
    assert resumed.resume() and resumed.step == 3
    last = resumed.run()[-1]
    assert last["loss"] == pytest.approx(records[-1]["loss"], rel=1e-5)
    assert resumed.pairs == whole.pairs


def test_on_policy_sampling_includes_the_greedy_reply(chat_run: Path) -> None:
    from kiln.chat import render
    from kiln.model.generate import generate
    from kiln.posttrain.align.preferences import SamplingConfig, _sample_chunk

    loaded = load_model(chat_run, dtype="fp32")
    tok = loaded.tokenizer
    assert tok is not None
    cfg = SamplingConfig(samples=3, max_new_tokens=12, temperature=1.0, top_k=None, greedy=True)
    replies = _sample_chunk(loaded.model, tok, RECORDS[:2], cfg, 0)
    special = set(tok.special_tokens.values())
    for record, got in zip(RECORDS[:2], replies, strict=True):
        assert len(got) == 3
        prompt = render(record["messages"][:-1], tok, add_generation_prompt=True).ids
        (greedy,) = generate(loaded.model, [prompt], 12, temperature=0.0)
        cut = next((i for i, t in enumerate(greedy) if t in special), len(greedy))
        assert got[-1].text == tok.decode(greedy[:cut])
        # without the switch, no reply is (in general) the greedy one
    plain = _sample_chunk(loaded.model, tok, RECORDS[:2], SamplingConfig(
        samples=3, max_new_tokens=12, temperature=1.0, top_k=None), 0)  # fmt: skip
    assert all(len(r) == 3 for r in plain)
