"""SFT replies that stop: trained on whole conversations (the ones longer than a row left out),
a small model's held-out replies end with <|end|> before the cap; trained on cut ones, they
run on (a cut reply has lost its end token, so it teaches that replies go on)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.eval.chat_tasks import evaluate_chat_tasks
from kiln.loading import load_model
from kiln.posttrain.replies import ReplySettings
from kiln.posttrain.sft.run import build_trainer, load_sft_config

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "sft.toml"
SEQ = 48


def conversation(k: int, words: list[str]) -> dict[str, object]:
    """A "continue" conversation: three words of a story, then 4-7 more (one in four: 60)."""
    start = 3 + 7 * k
    n = 60 if k % 4 != 0 else 4 + k % 5  # most replies are far longer than a row
    reply = " ".join(words[start + 3 : start + 3 + n])
    messages = [{"role": "user", "content": "Go on: " + " ".join(words[start : start + 3])},
                {"role": "assistant", "content": reply}]  # fmt: skip
    return {"id": f"c{k}", "task": "continue", "messages": messages,
            "params": {"start": "Qq qq.", "keywords": []}}  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, stories_text: str) -> tuple[Path, list]:
    words = stories_text.replace("<|endoftext|>", " ").split()
    root = tmp_path_factory.mktemp("stop")
    train = [conversation(k, words) for k in range(480)]
    with open(root / "train.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(c) + "\n" for c in train)
    held = [conversation(k, words) for k in range(480, 560) if k % 4 == 0]
    return root / "train.jsonl", held


def stop_rate(chat_run: Path, train: Path, held: list, tmp: Path, too_long: str) -> float:
    run = tmp / too_long
    cfg = load_sft_config(CONFIG, [
        f"sft.base={chat_run}", f"data.train={train}", "data.val=", f"data.seq_len={SEQ}",
        f"data.too_long={too_long}", "batch.global_tokens=384", "batch.micro_batch=8",
        "train.time_budget=none", "train.max_steps=200", "train.dtype=fp32", "eval.batches=0",
        "optim.lr=6e-3", "schedule.warmup_steps=5", "checkpoint.every=200", "logging.every=200",
        "logging.progress=false", f"logging.run_dir={run}", "lora.rank=0", "model.dropout=0",
    ])  # fmt: skip
    build_trainer(cfg, run).run()
    loaded = load_model(run, dtype="fp32")
    settings = ReplySettings(temperature=0.0, top_p=None, max_tokens=40)
    (result,) = evaluate_chat_tasks(loaded, held, settings)
    return result.stop_rate


def test_whole_conversations_teach_replies_to_stop(
    chat_run: Path, data: tuple[Path, list], tmp_path: Path
) -> None:
    train, held = data
    drop = stop_rate(chat_run, train, held, tmp_path, "drop")
    cut = stop_rate(chat_run, train, held, tmp_path, "cut")
    assert drop >= 0.95
    assert cut < 0.5  # the old behaviour
