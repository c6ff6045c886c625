"""`kiln sft`: the trainer on conversations from a pretrained base, exact resume (full and LoRA),
the base and data recorded in the resolved config, and the run loading like any run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.cli import main
from kiln.errors import KilnError
from kiln.io import sha256_file
from kiln.loading import load_model
from kiln.posttrain.sft.lora import LoRALinear
from kiln.posttrain.sft.run import SFTConfig, build_trainer, load_sft_config, rows_loss
from kiln.train.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "sft.toml"
FULL = ["lora.rank=0", "model.dropout=0.1"]  # dropout: the RNG state must resume too
LORA = ["lora.rank=4", "lora.dropout=0.1", "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def conversations(tmp_path_factory: pytest.TempPathFactory, stories_text: str) -> Path:
    """train.jsonl / val.jsonl: "continue this story" conversations of varied length."""
    root = tmp_path_factory.mktemp("conversations")
    stories = [s.strip() for s in stories_text.split("<|endoftext|>") if s.strip()]
    for name, part in (("train", stories[:-6]), ("val", stories[-6:])):
        with open(root / f"{name}.jsonl", "w", encoding="utf-8") as handle:
            for k, story in enumerate(part):
                words = story.split()
                cut = 3 + k % 5
                messages = [
                    {"role": "user", "content": "Continue: " + " ".join(words[:cut])},
                    {"role": "assistant", "content": " ".join(words[cut : cut + 4 + 3 * (k % 6)])},
                ]
                handle.write(json.dumps({"messages": messages}) + "\n")
    return root


def _config(chat_run: Path, data: Path, run: Path, *overrides: str) -> SFTConfig:
    return load_sft_config(
        CONFIG,
        [
            f"sft.base={chat_run}", f"data.train={data / 'train.jsonl'}",
            f"data.val={data / 'val.jsonl'}", "data.seq_len=32", "data.too_long=cut", "batch.global_tokens=256",
            "batch.micro_batch=4", "train.time_budget=none", "train.max_steps=6",
            "train.dtype=fp32", "eval.every=3", "eval.batches=1", "checkpoint.every=3",
            "logging.every=1", "logging.progress=false", f"logging.run_dir={run}",
            "schedule.warmup_steps=2", *overrides,
        ],
    )  # fmt: skip


def _metrics(run: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.kernels
@pytest.mark.parametrize("mode", [FULL, LORA], ids=["full", "lora"])
def test_interrupted_then_resumed_sft_equals_an_uninterrupted_one(
    chat_run: Path, conversations: Path, tmp_path: Path, mode: list[str]
) -> None:
    straight_run, cut_run = tmp_path / "straight", tmp_path / "cut"
    straight = build_trainer(_config(chat_run, conversations, straight_run, *mode), straight_run)
    uninterrupted = straight.run()

    def stop(trainer: Trainer, step: int, loss: float) -> None:
        if step == 2:
            trainer.request_stop()

    cfg = _config(chat_run, conversations, cut_run, *mode)
    first = build_trainer(cfg, cut_run, on_step=stop).run()
    assert first.interrupted and first.step == 2
    second = build_trainer(cfg, cut_run, resume=True).run()
    assert second.step == 6
    assert first.losses + second.losses == uninterrupted.losses  # bitwise on CPU fp32
    for key in ("loss", "grad_norm", "lr", "val_loss", "tokens"):
        a, b = _metrics(straight_run), _metrics(cut_run)
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    wa = load_file(straight_run / "checkpoints" / "step_6" / "model.safetensors")
    wb = load_file(cut_run / "checkpoints" / "step_6" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(".lora_A." in k for k in wa) == (mode is LORA)


def test_the_resolved_config_records_the_base_and_the_data(
    chat_run: Path, conversations: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = _config(chat_run, conversations, run, "train.max_steps=1", "eval.batches=0")
    build_trainer(cfg, run).run()
    state = json.loads((run / "checkpoints" / "step_1" / "state.json").read_text())
    for resolved in (state["config"], load_sft_config(run / "config.toml").to_dict()):
        weights = chat_run / "checkpoints" / "step_5" / "model.safetensors"
        assert resolved["sft"]["base_weights"] == str(weights)
        assert resolved["sft"]["base_sha256"] == sha256_file(weights)
        assert resolved["data"]["train_sha256"] == sha256_file(conversations / "train.jsonl")
        assert resolved["data"]["val_sha256"] == sha256_file(conversations / "val.jsonl")
    assert state["dataset"]["base_sha256"] == sha256_file(weights)
    other = tmp_path / "other.jsonl"
    other.write_text((conversations / "val.jsonl").read_text())
    with pytest.raises(KilnError, match=r"cannot resume.*data\.train_sha256"):
        build_trainer(
            _config(chat_run, conversations, run, "train.max_steps=2", f"data.train={other}"),
            run,
            resume=True,
        )


def test_a_lora_run_loads_merged_and_writes_a_peft_adapter(
    chat_run: Path, conversations: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kiln sft` with LoRA: RUN/adapter/ in PEFT's format; load_model(RUN) merges the adapters."""
    run = tmp_path / "lora"
    sets = [
        f"sft.base={chat_run}", f"data.train={conversations / 'train.jsonl'}", "data.val=",
        "data.seq_len=32", "data.too_long=cut", "batch.global_tokens=128", "batch.micro_batch=4",
        "train.time_budget=none", "train.max_steps=3", "train.dtype=fp32", "eval.batches=0",
        f"logging.run_dir={run}", "lora.rank=4", "optim.lr=1e-2",
    ]  # fmt: skip
    assert (
        main(["sft", str(CONFIG), *[a for s in sets for a in ("--set", s)], "--no-progress"]) == 0
    )
    out = capsys.readouterr().out
    assert "trainable parameters of" in out and "LoRA adapter of step 3" in out
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 4
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    other = tmp_path / "x"
    trainer = build_trainer(_config(chat_run, conversations, other, "lora.rank=4"), other)
    trainer.model.load_state_dict(load_file(run / "checkpoints" / "step_3" / "model.safetensors"))
    assert any(isinstance(m, LoRALinear) for m in trainer.model.modules())
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    adapters = {id(p) for n, p in trainer.model.named_parameters() if ".lora_" in n}
    assert optimized == adapters  # the frozen base is not in the trainer's optimizer
    loaded = load_model(run, dtype="fp32")
    assert not any(isinstance(m, LoRALinear) for m in loaded.model.modules())
    assert loaded.tokenizer is not None and "<|assistant|>" in loaded.tokenizer.special_tokens
    x = torch.randint(0, loaded.model.cfg.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), trainer.model.eval()(x), atol=1e-5, rtol=1e-5)
    base = load_model(chat_run, dtype="fp32").model
    rows = trainer.data.splits["val"]
    assert rows_loss(loaded.model, rows) != rows_loss(base, rows)  # it learned something


def test_an_sft_config_takes_its_model_from_the_base(chat_run: Path, tmp_path: Path) -> None:
    with pytest.raises(
        KilnError, match=r"model\.n_layer: the model is sft\.base's \(n_layer = 2\)"
    ):
        sets = [f"sft.base={chat_run}", "model.n_layer=3"]
        build_trainer(load_sft_config(CONFIG, sets), tmp_path / "r")
    with pytest.raises(KilnError, match=r"data\.layout = 'ragged': expected 'packed' or 'padded'"):
        load_sft_config(CONFIG, ["data.layout=ragged"])
    with pytest.raises(KilnError, match="no such conversations file"):
        sets = [f"sft.base={chat_run}", f"data.train={tmp_path / 'none.jsonl'}"]
        build_trainer(load_sft_config(CONFIG, sets), tmp_path / "r")
