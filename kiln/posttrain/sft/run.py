"""Supervised fine-tuning: `kiln sft CONFIG.toml` trains a pretrained model on conversations.

The entry point is its own command, not `kiln train` with a `[finetune]` section: its inputs
are other artifacts (a model folder with the chat tokens and JSON lines of conversations, not a
token-shard dataset and a model preset), so a separate config keeps each command's schema strict
(a typo or a section that means nothing to that command is an error). What it shares with
pre-training it shares by code: `SFTConfig` is a `TrainConfig` (the same optim, schedule, batch,
train, eval, checkpoint and logging sections) and the run is kiln.train's `Trainer`, given
conversation rows (`ConversationData`) and a hook that loads the base weights (and adds LoRA
adapters) into the fresh model. Checkpoints, exact resume, metrics, the progress bar and
`kiln plot` are therefore those of pre-training.

The resolved config (config.toml, and every checkpoint's state.json) records the base: the
checkpoint or file its weights came from and that file's sha256, and the conversation files'
sha256; resuming with another base or other data is refused. The run folder gets a copy of the
base's tokenizer, so `kiln.loading` loads an SFT run like any run (a LoRA run merged), and a
LoRA run writes `adapter/` (PEFT's format) after each training call.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from kiln import config as cfgio
from kiln.config import require
from kiln.data.loader import LoaderCursor
from kiln.errors import KilnError
from kiln.io import sha256_file
from kiln.loading import find_checkpoint, folder_kind, load_model
from kiln.model.transformer import Transformer
from kiln.posttrain.sft import lora as lora_mod
from kiln.posttrain.sft.lora import LoRAConfig
from kiln.posttrain.sft.packing import LAYOUTS, TOO_LONG, RowLoader, Rows, build_rows, describe
from kiln.tokenizer.special import EOT
from kiln.tokenizer.tokenizer import Tokenizer
from kiln.train.config import TrainConfig
from kiln.train.trainer import Trainer

ADAPTER_DIR = "adapter"
MODEL_FIELDS_ALLOWED = ("dropout",)  # the model is the base's; only these may be changed


@dataclass
class SFTData:
    """The `[data]` section of an SFT run: conversation files and how they become rows."""

    train: str = ""  # JSON lines of conversations ({"messages": [...]}), e.g. `kiln data chat`'s
    val: str = ""  # held-out conversations for the val loss ("": none)
    seq_len: int = 256  # positions per row; longer conversations are cut
    seed: int = 0  # the rows' order in each epoch
    layout: Literal["packed", "padded"] = "packed"  # see kiln/posttrain/sft/packing.py
    # A conversation longer than seq_len: "drop" it (its reply keeps its <|end|> or is not
    # trained on), or "cut" it (the cut reply teaches not stopping; replies then rarely stop).
    too_long: Literal["drop", "cut"] = "drop"
    # Filled in when the run starts (the resolved config records what was trained on):
    train_sha256: str = ""
    val_sha256: str = ""

    def __post_init__(self) -> None:
        require(bool(self.train), "data.train: give the JSON-lines file of conversations")
        require(self.seq_len >= 2, f"data.seq_len must be >= 2, got {self.seq_len}")
        require(
            self.layout in LAYOUTS,
            f"data.layout must be one of {', '.join(LAYOUTS)}; got {self.layout!r}",
        )
        require(
            self.too_long in TOO_LONG,
            f"data.too_long must be one of {', '.join(TOO_LONG)}; got {self.too_long!r}",
        )


@dataclass
class SFTSection:
    """The `[sft]` section: the pretrained model to start from."""

    base: str = ""  # a run, checkpoint or HF folder whose tokenizer has the chat tokens
    # Filled in when the run starts: the file the base weights came from, and its sha256.
    base_weights: str = ""
    base_sha256: str = ""

    def __post_init__(self) -> None:
        require(bool(self.base), "sft.base: give the pretrained model folder (with chat tokens)")


@dataclass
class SFTConfig(TrainConfig):
    """A fine-tuning run: TrainConfig's sections, conversation data, the base and LoRA."""

    data: SFTData = field(default_factory=SFTData)  # type: ignore[assignment]
    sft: SFTSection = field(default_factory=SFTSection)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


def load_sft_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> SFTConfig:
    """Read an SFTConfig from TOML with `--set` overrides; errors name the file and the key."""
    return cfgio.load(SFTConfig, path, overrides)


def model_fields(base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The run's [model]: the base's fields, with the few a fine-tune may change.

    Other fields may be given only with the base's value (a resolved config.toml repeats them).
    """
    for key, value in sorted(given.items()):
        if key not in MODEL_FIELDS_ALLOWED and base.get(key) != value:
            raise KilnError(
                f"model.{key}: the model is sft.base's ({key} = {base.get(key)!r}); an SFT "
                f"config may change only {', '.join('model.' + f for f in MODEL_FIELDS_ALLOWED)}"
            )
    return {**base, **given}


# ---- the data -----------------------------------------------------------------------------------


def render_file(path: str | Path, tokenizer: Tokenizer) -> list[tuple[list[int], list[int]]]:
    """Every conversation of a JSON-lines file, rendered to (ids, loss_mask)."""
    from kiln.chat import iter_conversations, render

    name = str(path)
    if not Path(path).is_file():
        raise KilnError(f"{name}: no such conversations file")
    out = []
    for number, record in enumerate(iter_conversations(path), start=1):
        rendered = render(record["messages"], tokenizer, where=f"{name}: conversation {number}")
        out.append((rendered.ids, rendered.loss_mask))
    if not out:
        raise KilnError(f"{name}: no conversations")
    return out


class ConversationData:
    """Conversation rows as the Trainer's data (kiln.train.sources.TrainData)."""

    def __init__(
        self, splits: dict[str, Rows], vocab_size: int, fingerprint: dict[str, Any]
    ) -> None:
        self.splits, self.vocab_size, self._fingerprint = splits, vocab_size, fingerprint

    def fingerprint(self) -> dict[str, Any]:
        """Tokenizer, base weights and conversation files, by sha256, and the rows' layout."""
        return dict(self._fingerprint)

    def _rows(self, split: str, seq_len: int) -> Rows:
        if split not in self.splits:
            raise KilnError(f"no {split} conversations (set data.{split}, or eval.batches = 0)")
        rows = self.splits[split]
        if rows.seq_len != seq_len:
            raise KilnError(f"{split} rows have {rows.seq_len} positions, not {seq_len}")
        return rows

    def loader(
        self,
        split: str,
        seq_len: int,
        batch_size: int,
        seed: int,
        cursor: LoaderCursor | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> RowLoader:
        """A RowLoader over the split's rows."""
        rows = self._rows(split, seq_len)
        return RowLoader(rows, batch_size, seed, cursor, rank, world_size, f"{split} rows")

    def val_rows(self, seq_len: int) -> int:
        """Rows of held-out conversations."""
        return self._rows("val", seq_len).n_rows

    def sampler(self, ev: Any, seed: int) -> None:
        """No continuation samples: a chat model is sampled with `kiln chat` instead."""
        return None


# ---- setting a run up -------------------------------------------------------------------------


@dataclass
class Prepared:
    """An SFT run ready for the Trainer: the resolved config, its data, the model hook."""

    cfg: SFTConfig
    data: ConversationData
    prepare_model: Callable[[Transformer], None]  # called once, by the Trainer
    base: str  # where the base came from, for the log
    tokenizer: Path  # the base's tokenizer file
    notes: list[str]


def base_weights_file(path: str | Path) -> Path:
    """The weights file of a base model folder (a checkpoint's, or an HF folder's)."""
    path = Path(path)
    if folder_kind(path) == "hf":
        found = next((path / n for n in ("model.safetensors", "pytorch_model.bin")
                      if (path / n).is_file()), None)  # fmt: skip
        if found is None:
            raise KilnError(f"{path}: sft.base needs a single weights file (model.safetensors)")
        return found
    return find_checkpoint(path) / "model.safetensors"


def prepare(cfg: SFTConfig) -> Prepared:
    """Load the base and the conversations; resolve the config; build the data and the hook."""
    from kiln.chat import require_chat_template

    base = load_model(cfg.sft.base, device="cpu", dtype="fp32")
    tok, tokenizer_path = base.tokenizer, base.tokenizer_path
    assert tok is not None and tokenizer_path is not None
    require_chat_template(tok, f"sft.base {cfg.sft.base}")
    base_fields = {k: v for k, v in base.model.cfg.to_dict().items() if v is not None}
    model = model_fields(base_fields, cfg.model)
    weights = base_weights_file(cfg.sft.base)
    sft = dataclasses.replace(cfg.sft, base_weights=str(weights), base_sha256=sha256_file(weights))
    pad = tok.special_tokens.get(EOT, 0)
    files = {"train": cfg.data.train, "val": cfg.data.val}
    splits = {
        name: build_rows(
            render_file(path, tok), cfg.data.seq_len, cfg.data.layout, pad, cfg.data.too_long
        )
        for name, path in files.items()
        if path
    }
    data_cfg = dataclasses.replace(
        cfg.data,
        train_sha256=sha256_file(cfg.data.train),
        val_sha256=sha256_file(cfg.data.val) if cfg.data.val else "",
    )
    resolved = dataclasses.replace(cfg, data=data_cfg, sft=sft, model=model)
    fingerprint = {
        "tokenizer_sha256": sha256_file(tokenizer_path),
        "vocab_size": tok.n_vocab,
        "base_sha256": sft.base_sha256,
        "layout": cfg.data.layout,
        "too_long": cfg.data.too_long,
        **{f"{name}_sha256": rows.sha256() for name, rows in splits.items()},
        **{f"{name}_rows": rows.n_rows for name, rows in splits.items()},
    }
    notes = [f"{name} rows: {_counts(describe(rows))}" for name, rows in splits.items()]
    base_state = base.model.state_dict()

    def prepare_model(model: Transformer) -> None:
        """Base weights into the fresh model; then adapters (LoRA) with the base frozen."""
        with torch.no_grad():
            model.load_state_dict(base_state)
        base_state.clear()  # the base's tensors are not kept beside the model's
        if cfg.lora.enabled:
            lora_mod.add_lora(model, cfg.lora)

    data = ConversationData(splits, tok.n_vocab, fingerprint)
    return Prepared(resolved, data, prepare_model, base.source, tokenizer_path, notes)


def _counts(counts: dict[str, Any]) -> str:
    """'rows 12, conversations 40, ..., fill 87%' for the log."""
    return ", ".join(
        f"{k} {v:,}" if isinstance(v, int) else f"{k} {v:.0%}" for k, v in counts.items()
    )


def copy_tokenizer(source: Path, run_dir: Path) -> Path:
    """The base's tokenizer into the run folder (how kiln.loading finds a run's tokenizer)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "tokenizer.json"
    if target.is_file():
        if sha256_file(target) != sha256_file(source):
            raise KilnError(
                f"{target} is not the base's tokenizer ({source}); use another logging.run_dir"
            )
        return target
    tmp = run_dir / ".tokenizer.json.tmp"
    shutil.copyfile(source, tmp)
    tmp.replace(target)
    return target


def build_trainer(
    cfg: SFTConfig, run_dir: str | Path, resume: bool = False, **kwargs: Any
) -> Trainer:
    """The Trainer of an SFT run (base loaded, data rendered, tokenizer beside the run)."""
    prepared = prepare(cfg)
    copy_tokenizer(prepared.tokenizer, Path(run_dir))
    trainer = Trainer(
        prepared.cfg, run_dir, resume=resume, data=prepared.data,
        prepare_model=prepared.prepare_model, **kwargs,
    )  # fmt: skip
    trainer.notes += prepared.notes
    trainer.say(f"kiln sft: base {prepared.base}")
    for note in prepared.notes:
        trainer.say(f"kiln sft: {note}")
    trainer.say(f"kiln sft: {describe_trainable(trainer)}")
    return trainer


def describe_trainable(trainer: Trainer) -> str:
    """Trainable parameters of the run, against all of the model's."""
    total = sum(p.numel() for p in trainer.model.parameters())
    trainable = lora_mod.trainable_parameters(trainer.model)
    return f"{trainable:,} trainable parameters of {total:,} ({trainable / total:.2%})"


def write_adapter(trainer: Trainer) -> Path | None:
    """A LoRA run's adapters in PEFT's format, in <run>/adapter/ (None for full fine-tuning)."""
    cfg = trainer.cfg
    assert isinstance(cfg, SFTConfig)
    if not cfg.lora.enabled or not trainer.dist.is_main:
        return None
    return lora_mod.save_adapter(
        trainer.model, cfg.lora, trainer.run_dir / ADAPTER_DIR, cfg.sft.base
    )


# ---- measuring ------------------------------------------------------------------------------------


@torch.no_grad()
def rows_loss(model: torch.nn.Module, rows: Rows, batch: int = 16) -> float:
    """Mean loss per counted target over all `rows` (each target weighs the same)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, rows.n_rows, batch):
        x = torch.from_numpy(rows.inputs[start : start + batch]).to(device)
        y = torch.from_numpy(rows.targets[start : start + batch]).to(device)
        extra = []
        if rows.segments is not None:
            extra.append(torch.from_numpy(rows.segments[start : start + batch]).to(device))
        n = int((y >= 0).sum())
        if n:
            total += float(model(x, y, *extra)) * n
            count += n
    model.train(was_training)
    return total / count if count else math.nan
