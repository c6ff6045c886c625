"""TrainConfig: the sections of a `kiln train` TOML file, their defaults and their checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kiln import config as cfgio
from kiln.config import ConfigError, require
from kiln.model.config import ModelConfig, ModelConfigError
from kiln.train.budget import parse_duration

DEFAULT_MAX_STEPS = 1000  # the length of a run that gives neither max_steps nor time_budget

_check = require  # the one config check (kiln/config.py), raising ConfigError


@dataclass
class DataConfig:
    """Which token-shard dataset to read, and how it is cut into windows."""

    dataset: str = ""  # a dataset directory written by `kiln data tokenize`
    seq_len: int = 256  # tokens per training window (T); each window reads T + 1
    seed: int = 0  # fixes the epoch permutations of the window stream

    def __post_init__(self) -> None:
        _check(bool(self.dataset), "data.dataset: give the token-shard dataset directory")
        _check(self.seq_len >= 1, f"data.seq_len must be >= 1, got {self.seq_len}")


@dataclass
class OptimConfig:
    """AdamW for everything, or Muon for 2-D hidden matrices with AdamW for the rest."""

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-4  # peak learning rate (Muon uses it too, RMS-matched to AdamW)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only (not biases, norms or embeddings)
    fused: bool | None = None  # None: fused AdamW where the device supports it
    muon_momentum: float = 0.95

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"optim.lr must be > 0, got {self.lr}")
        _check(all(0 <= b < 1 for b in self.betas), f"optim.betas must be in [0, 1): {self.betas}")
        _check(self.eps > 0, f"optim.eps must be > 0, got {self.eps}")
        _check(self.weight_decay >= 0, f"optim.weight_decay must be >= 0: {self.weight_decay}")


@dataclass
class ScheduleConfig:
    """Learning-rate multiplier over steps: warmup then cosine, or warmup-stable-decay."""

    name: Literal["warmup_cosine", "wsd"] = "warmup_cosine"
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly to the floor
    min_lr_ratio: float = 0.1  # floor as a fraction of the peak lr

    def __post_init__(self) -> None:
        _check(self.warmup_steps >= 0, f"schedule.warmup_steps must be >= 0: {self.warmup_steps}")
        _check(
            0 <= self.decay_fraction <= 1,
            f"schedule.decay_fraction must be in [0, 1], got {self.decay_fraction}",
        )
        _check(
            0 <= self.min_lr_ratio <= 1,
            f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}",
        )


@dataclass
class BatchConfig:
    """Global batch in tokens per optimizer step; micro-batch in sequences per forward pass."""

    global_tokens: int = 16384
    # "auto" (CUDA only): the largest that fits, by a short probe (kiln/train/micro_batch.py)
    micro_batch: int | Literal["auto"] = 8

    def __post_init__(self) -> None:
        _check(self.global_tokens >= 1, f"batch.global_tokens must be >= 1: {self.global_tokens}")
        _check(
            self.micro_batch == "auto" or self.micro_batch >= 1,
            f"batch.micro_batch must be >= 1 or 'auto': {self.micro_batch}",
        )


@dataclass
class TrainSection:
    """How long and how: steps or a time budget, clipping, precision, compile, device, seed.

    Length: `max_steps` alone trains that many steps (1000 when neither is given). `time_budget`
    (seconds, or "90s", "10m", "1h") trains for that much training time, evaluation and
    checkpoints not counted: the trainer plans max_steps from the measured step time so the lr
    schedule ends at the budget (see kiln/train/budget.py); a `max_steps` given with it is an
    upper bound on that plan.
    """

    max_steps: int | None = None
    time_budget: float | str | None = None
    grad_clip: float = 1.0  # global gradient-norm limit; 0 turns clipping off
    # Autocast dtype of matmuls (weights stay fp32). "auto": bf16 where the device runs it
    # natively (CUDA with bf16, a CPU with AVX512_BF16/AMX that a probe confirms), else fp32.
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    compile: bool = False
    device: str = "auto"  # "auto": cuda when available, else cpu
    seed: int = 0  # model initialisation and any sampling in training (dropout)
    skip_nonfinite: bool = False  # skip a step with a non-finite loss/gradient instead of stopping
    memory_check: bool = True  # stop before the first step when the memory pre-flight says no
    # Data parallelism under torchrun: "ddp" (every rank holds the model), "fsdp" (FSDP2: each
    # rank holds a shard), "auto" (ddp; the [parallel] mesh when it asks for more than 1-D data
    # parallelism), "mesh" (the [parallel] mesh even when it is 1-D: sharded checkpoints),
    # "none" (one process only). Ignored with one process unless "mesh".
    parallel: Literal["auto", "none", "ddp", "fsdp", "mesh"] = "auto"
    # fp8 training matmuls for the linear layers (not the head; kiln/quant/fp8_train.py): "tensor"
    # (dynamic per-tensor scales), "tensor_delayed" (amax history), "block" (1×128 / 128×128
    # DeepSeek-V3 tiles). torch._scaled_mm on CUDA capability 8.9+, exact emulation elsewhere.
    fp8: Literal["off", "tensor", "tensor_delayed", "block"] = "off"

    def __post_init__(self) -> None:
        if self.max_steps is None and self.time_budget is None:
            self.max_steps = DEFAULT_MAX_STEPS
        if self.max_steps is not None:
            _check(self.max_steps >= 1, f"train.max_steps must be >= 1, got {self.max_steps}")
        if self.time_budget is not None:
            parse_duration(self.time_budget)  # a clear error now, not when training starts
        _check(self.grad_clip >= 0, f"train.grad_clip must be >= 0, got {self.grad_clip}")
        modes = ("auto", "none", "ddp", "fsdp", "mesh")
        _check(
            self.parallel in modes,
            f"train.parallel must be one of {', '.join(modes)}; got {self.parallel!r}",
        )
        fp8_modes = ("off", "tensor", "tensor_delayed", "block")
        _check(
            self.fp8 in fp8_modes,
            f"train.fp8 must be one of {', '.join(fp8_modes)}; got {self.fp8!r}",
        )

    @property
    def budget_seconds(self) -> float | None:
        """`time_budget` in seconds, or None when the run is sized by max_steps alone."""
        return None if self.time_budget is None else parse_duration(self.time_budget)


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass
class ParallelConfig:
    """The DeviceMesh: pp × dp_replicate × dp_shard × tp processes (see docs/distributed.md).

    dp_shard = -1 takes whatever the world size leaves. Activation checkpointing recomputes
    every `ac_every`-th block in backward ("full"), or none.
    """

    dp_replicate: int = 1  # HSDP: copies of the sharded model, gradients all-reduced between them
    dp_shard: int = -1  # FSDP2 shards within one copy
    tp: int = 1  # tensor parallelism: heads and MLP columns split (Megatron-style)
    pp: int = 1  # pipeline ranks; micro-batches per step: global batch / (dp × micro_batch × T)
    sequence_parallel: bool = True  # with tp > 1: norms and the residual stream split on T
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    pp_stages_per_rank: int = 0  # 0: 2 for interleaved_1f1b, else 1
    activation_checkpointing: Literal["none", "full"] = "none"
    ac_every: int = 1  # with "full": recompute every k-th block (1: all)
    async_checkpoint: bool = False  # sharded saves written in the background (DCP async_save)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "ac_every"):
            value = getattr(self, name)
            _check(value >= 1, f"parallel.{name} must be >= 1, got {value}")
        _check(
            self.dp_shard == -1 or self.dp_shard >= 1,
            f"parallel.dp_shard must be >= 1 or -1 (the rest of the world size), got {self.dp_shard}",
        )
        _check(
            self.pp_schedule in PP_SCHEDULES,
            f"parallel.pp_schedule must be one of {', '.join(PP_SCHEDULES)}; got {self.pp_schedule!r}",
        )
        _check(
            self.activation_checkpointing in ("none", "full"),
            "parallel.activation_checkpointing must be 'none' or 'full'; got "
            f"{self.activation_checkpointing!r}",
        )

    @property
    def multi_dim(self) -> bool:
        """Whether it asks for more than 1-D data parallelism (tp, pp or HSDP)."""
        return self.tp > 1 or self.pp > 1 or self.dp_replicate > 1

    def shape(self, world_size: int) -> dict[str, int]:
        """{"pp", "dp_replicate", "dp_shard", "tp"} for `world_size` processes, or a clear error."""
        other = self.pp * self.dp_replicate * self.tp
        shard = self.dp_shard
        if shard == -1:
            _check(
                world_size % other == 0,
                f"parallel: pp × dp_replicate × tp = {self.pp} × {self.dp_replicate} × {self.tp} "
                f"= {other} does not divide WORLD_SIZE={world_size}",
            )
            shard = world_size // other
        total = other * shard
        _check(
            total == world_size,
            f"parallel: pp × dp_replicate × dp_shard × tp = {self.pp} × {self.dp_replicate} × "
            f"{shard} × {self.tp} = {total} but WORLD_SIZE={world_size}; change the sizes or "
            "the number of processes (dp_shard = -1 takes what the others leave)",
        )
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": shard, "tp": self.tp}


@dataclass
class EvalConfig:
    """Val loss every `every` steps (0: at the end) on fixed val batches; samples at those steps."""

    every: int = 100
    batches: int = 8
    sample_prompts: list[str] = field(default_factory=lambda: ["Once upon a time", "The"])
    sample_tokens: int = 48  # new tokens per prompt, into samples.jsonl; 0: no samples
    allow_special: bool = False  # sample_prompts may spell special tokens (encoded as those)

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"eval.every must be >= 0, got {self.every}")
        _check(self.batches >= 0, f"eval.batches must be >= 0 (0: no eval), got {self.batches}")
        _check(self.sample_tokens >= 0, f"eval.sample_tokens must be >= 0: {self.sample_tokens}")


@dataclass
class CheckpointConfig:
    """A checkpoint every `every` steps (and at the end); only the newest `keep_last` are kept."""

    every: int = 500
    keep_last: int = 3

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"checkpoint.every must be >= 0, got {self.every}")
        _check(self.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {self.keep_last}")


@dataclass
class LoggingConfig:
    """Metrics every `every` steps to `run_dir`/metrics.jsonl (and TensorBoard, W&B if turned on)."""

    every: int = 10
    run_dir: str = ""  # "": runs/<config file name>
    progress: bool = True
    tensorboard: bool = False  # needs `pip install tensorboard`
    wandb: bool = False  # offline mode, under `run_dir`/wandb; needs `pip install wandb`
    wandb_project: str = "kiln"

    def __post_init__(self) -> None:
        _check(self.every >= 1, f"logging.every must be >= 1, got {self.every}")


@dataclass
class TrainConfig:
    """A whole training run. `model` is a preset name plus ModelConfig field overrides."""

    data: DataConfig
    model: dict[str, Any] = field(
        default_factory=dict, metadata={"schema": ModelConfig, "extra": {"preset": str}}
    )
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The ModelConfig this run trains; `vocab_size` (the dataset's) fills it in if unset."""
        fields = dict(self.model)
        preset = fields.pop("preset", None)
        if vocab_size is not None and "vocab_size" not in fields:
            fields["vocab_size"] = vocab_size
        try:
            cfg = ModelConfig.preset(preset, **fields) if preset else ModelConfig.from_dict(fields)
        except ModelConfigError as exc:
            raise ConfigError(f"model: {exc}") from None
        _check(
            self.data.seq_len <= cfg.block_size,
            f"data.seq_len ({self.data.seq_len}) is longer than model.block_size "
            f"({cfg.block_size})",
        )
        if vocab_size is not None:
            _check(
                cfg.vocab_size >= vocab_size,
                f"model.vocab_size ({cfg.vocab_size}) is smaller than the dataset's vocabulary "
                f"({vocab_size}); leave it unset to take the dataset's",
            )
        return cfg

    def resolved(self, model: ModelConfig) -> TrainConfig:
        """This config with the model section replaced by every field of `model` (no preset)."""
        # None fields mean "the default" and TOML cannot write them: leave them out.
        return dataclasses.replace(self, model=_without_none(model.to_dict()))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (TOML-ready; None values are dropped by the writer)."""
        return cfgio.to_dict(self)

    def to_toml(self) -> str:
        """The config as TOML text that `load_train_config` reads back to an equal config."""
        return cfgio.to_toml(self.to_dict(), header="kiln train config (fully resolved)")


def _without_none(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` without None values, in nested sections too (e.g. model.ssm)."""
    return {
        k: _without_none(v) if isinstance(v, dict) else v
        for k, v in fields.items()
        if v is not None
    }


def load_train_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> TrainConfig:
    """Read a TrainConfig from TOML with `--set` overrides; errors name the file and the key."""
    return cfgio.load(TrainConfig, path, overrides)


def default_run_dir(cfg: TrainConfig, config_path: str | Path | None) -> Path:
    """The run directory: logging.run_dir, else runs/<config file stem>."""
    if cfg.logging.run_dir:
        return Path(cfg.logging.run_dir)
    stem = Path(config_path).stem if config_path else "train"
    return Path("runs") / stem
