"""The training loop: one path for one process, DDP, FSDP and any [parallel] mesh.

`Trainer` builds the run (model, optimizer, loader; resuming if asked) and trains it. How the run
spreads over processes is its `ParallelPlan` (parallel_plan.py): one process is the degenerate
mesh, so the loop has no branch per kind of parallelism. One optimizer step is step.py's
accumulation over micro-steps; the val loss and its set are evaluation.py's; what a checkpoint
records and how a run resumes from it are resume.py's (the files: checkpoint.py and
sharded_checkpoint.py). The memory pre-flight (preflight.py) runs before the model is allocated.

Everything that decides the next step is in a checkpoint and the lr is a pure function of the
step, so a resumed run takes the same steps as an uninterrupted one (bit for bit on the CPU).
The run's length is train.max_steps, or the plan train.time_budget re-makes after every step
from the measured step time (budget.py).

Under torchrun every rank runs this same loop on its slice of each global batch. The numbers a
user sees are global: the logged loss is the mean over data-parallel ranks, the gradient norm is
that of the whole (synchronised or sharded) gradient, the val loss is over one fixed val set
split across ranks. Every rank takes part in each checkpoint; only rank 0 writes files (or, on a
[parallel] mesh, every rank its own shards).
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln import config as cfgio
from kiln.checkpoint_format import latest_checkpoint, step_dir
from kiln.devices import resolve_device
from kiln.errors import KilnError
from kiln.folders import lock_folder
from kiln.io import atomic_write
from kiln.model import ModelConfig, Transformer
from kiln.model.moe import balance_experts
from kiln.train import checkpoint as ckpt
from kiln.train import distributed, preflight
from kiln.train.budget import TimeBudget, intro_line, summary_line
from kiln.train.config import TrainConfig
from kiln.train.distributed import DistInfo
from kiln.train.evaluation import is_due, val_loss, val_set
from kiln.train.loggers import Loggers, check_backends
from kiln.train.metrics import MetricsLog, device_peak_flops, mfu
from kiln.train.mup import apply_mup_init, mup_record
from kiln.train.optim import build_optimizer, set_lr
from kiln.train.parallel_plan import ParallelPlan
from kiln.train.progress import progress_bar, set_total, show_record, silent, tqdm_write
from kiln.train.resume import (
    ResumePoint,
    find_resume_point,
    resumed_from,
    run_precision,
    seed_rank,
)
from kiln.train.samples import eval_sampler, format_sample
from kiln.train.schedule import lr_multiplier
from kiln.train.sources import TokenShards, TrainData
from kiln.train.step import (
    NonFiniteError,
    accumulate,
    accumulation_steps,
    autocast,
    nonfinite_message,
)
from kiln.train.stopping import StopRequest

__all__ = ["DistInfo", "NonFiniteError", "RunResult", "Trainer", "accumulation_steps"]


@dataclass
class RunResult:
    """What a call to `Trainer.run` did."""

    step: int
    tokens: int
    losses: list[float] = field(default_factory=list)  # one per step taken in this call
    val_loss: float | None = None
    interrupted: bool = False
    signal: int | None = None  # the signal that asked for the stop, if one did
    checkpoint: Path | None = None


class Trainer:
    """Builds the model, optimizer and loader of a TrainConfig (resuming if asked) and trains."""

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: str | Path,
        resume: bool = False,
        dist: DistInfo | None = None,
        on_step: Callable[[Trainer, int, float], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        data: TrainData | None = None,
        prepare_model: Callable[[Transformer], None] | None = None,
    ) -> None:
        # `data`: the batches (default: cfg.data.dataset's shards); `prepare_model` edits the new
        # model before it is wrapped and optimised (post-training loads its base weights and adds
        # adapters there; only parameters that require grad are optimised). No DistInfo given:
        # torchrun's environment says (rank 0 of 1 without torchrun).
        self.dist = dist or DistInfo.from_env()
        self.run_dir = Path(run_dir)
        self.checkpoints = self.run_dir / "checkpoints"
        self.on_step = on_step
        self.clock = clock  # times the training steps (a test passes a fake one)
        self.say = print if self.dist.is_main else silent
        self.device = resolve_device(cfg.train.device, self.dist.local_rank)
        distributed.join_from_env(self.device, self.dist)
        self.data = data if data is not None else TokenShards(cfg.data.dataset)
        self.model_cfg: ModelConfig = cfg.model_config(self.data.vocab_size)
        self.cfg = cfg.resolved(self.model_cfg)
        check_backends(self.cfg)  # on every rank: a missing package fails everywhere, at once
        self.sampler = eval_sampler(self.cfg, self.dist, self.data)  # bad prompts fail here
        point, self.notes = find_resume_point(
            self.checkpoints, resume, self.cfg.to_dict(), self.data.fingerprint()
        )
        self.plan = ParallelPlan.build(self.cfg, self.dist, self.device, point and point.path)
        if (line := self.plan.describe()) is not None:
            self.say(f"kiln train: {line}")
        self.precision = run_precision(self.cfg.train.dtype, self.device, self.dist, point)
        for line in self.precision.lines("kiln train"):
            self.say(line)
        self._build(prepare_model, point)
        self._resume(point)
        self._open_data()

    # ---- setup: build, resume, data ---------------------------------------------------------

    def _build(
        self, prepare_model: Callable[[Transformer], None] | None, point: ResumePoint | None
    ) -> None:
        """Check the memory, then make the model, wrap it for the plan, build the optimizer."""
        cfg = self.cfg
        auto_micro = cfg.batch.micro_batch == "auto"  # probed once the model is built
        if auto_micro and self.plan.pipelined:
            raise KilnError("batch.micro_batch = 'auto' is not supported with parallel.pp > 1")
        self.data_rank, self.data_ranks = self.plan.mesh.dp_rank, self.plan.mesh.dp_size
        self.accum = self.plan.split_accumulation(
            accumulation_steps(
                cfg.batch.global_tokens, self.data_ranks, 1 if auto_micro else cfg.batch.micro_batch,
                cfg.data.seq_len,
            )
        )  # fmt: skip
        for line in preflight.check(  # a run that would not fit stops here, with advice
            self.model_cfg, cfg, self.plan.mesh.shape, self.precision.name, self.device,
            self.plan.microbatches,
        ):  # fmt: skip
            self.say(f"kiln train: {line}")
        if self.dist.is_main:  # what a killed run left: temp/trash folders, an unfinished prune
            # Held while this Trainer lives (the OS drops it if the process dies): a second
            # trainer on this folder would delete the live run's temp files in its tidy.
            self._run_lock = lock_folder(self.run_dir, "kiln train", "run folder")
            keep = cfg.checkpoint.keep_last if point is not None else None
            self.notes += ckpt.tidy(self.checkpoints, keep)
        if self.device.type == "cuda":  # TF32 matmuls: fp32 range, ~10-bit mantissa, far faster
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(cfg.train.seed)
        model = Transformer(self.model_cfg).to(self.device)
        apply_mup_init(model)  # µP's init when model.mup_base_width is set (else no-op)
        if prepare_model is not None:
            prepare_model(model)
        self.fp8 = self._fp8(model)
        # torchtitan's order: parallelize (FSDP2 shards the parameters in place), then build the
        # optimizer over the parameters as they now are, then load a checkpoint into both.
        # self.model: this rank's part (a pipeline stage's modules); train_model: what runs.
        self.model, self.train_model = self.plan.apply(model, self.cfg)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        if auto_micro:  # the largest that fits, by a probe on the GPU
            from kiln.train.micro_batch import resolve_auto

            cfg = self.cfg = resolve_auto(self)
            self.accum = accumulation_steps(
                cfg.batch.global_tokens, self.data_ranks, cfg.batch.micro_batch, cfg.data.seq_len
            )

    def _fp8(self, model: Transformer) -> dict[str, Any]:
        """train.fp8: swap the linear layers for fp8 ones before wrapping; what was chosen."""
        mode = self.cfg.train.fp8
        if mode == "off":
            return {"mode": "off"}
        if self.dist.world_size > 1 and self.cfg.parallel.multi_dim:
            raise KilnError("train.fp8 is not supported with parallel.tp > 1, pp > 1 or HSDP")
        from kiln.quant.fp8_train import enable_fp8_training

        info = enable_fp8_training(model, mode, self.device)
        self.say(f"kiln train: fp8 {mode} ({info['recipe']}) on {info['layers']} linear layers, "
                 f"{info['backend']}: {info['why']}")  # fmt: skip
        return info

    def _resume(self, point: ResumePoint | None) -> None:
        """Seed this rank, then take back the checkpoint's weights, counters and RNG, if any."""
        cfg = self.cfg
        seed_rank(cfg.train.seed, self.dist.rank)
        resumed, planned = None, None
        if point is not None:
            self.plan.load(point.path, self.model, self.optimizer, self.device)
            budget = (cfg.train.budget_seconds, cfg.train.max_steps)
            resumed, notes = resumed_from(point, budget, cfg.train.seed, self.dist)
            self.notes += notes
            planned = resumed.planned_steps
        self.step = resumed.step if resumed else 0
        self.tokens = resumed.tokens if resumed else 0
        self.skipped = resumed.skipped if resumed else 0
        # training time so far (eval, samples, checkpoints excluded)
        self.train_seconds = resumed.train_seconds if resumed else 0.0
        self.cursor = resumed.cursor if resumed else None
        self.last_saved = self.step if point is not None else -1
        budget = cfg.train.budget_seconds
        self.budget = (
            None
            if budget is None
            else TimeBudget(budget, cfg.train.max_steps, self.train_seconds, planned)
        )
        # The schedule's length: fixed, or the budget's plan (re-made after every step).
        self.max_steps: int = (
            cfg.train.max_steps if self.budget is None else self.budget.plan(self.step)
        )

    def _open_data(self) -> None:
        """The train loader at the resumed cursor, the val set, the logs and config.toml."""
        cfg = self.cfg
        B, T, W = cfg.batch.micro_batch * self.plan.microbatches, cfg.data.seq_len, self.data_ranks
        self.loader = self.data.loader(
            "train", T, W * B, cfg.data.seed, self.cursor, self.data_rank, W
        )  # one pipeline step reads all its micro-batches at once
        self.val_batches: list[tuple[Any, ...]] = []
        self.val_windows = 0
        if cfg.eval.batches > 0:
            self.val_batches, self.val_windows = val_set(
                self.data, T, cfg.batch.micro_batch, cfg.eval.batches, cfg.data.seed,
                self.data_rank, W, self.device,
            )  # fmt: skip
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.samples = MetricsLog(self.run_dir / "samples.jsonl")  # {"step", "prompt", "text"}
        self.loggers = Loggers([])  # the TensorBoard / W&B backends, opened by run() on rank 0
        self.flops_per_token = self.model_cfg.flops_per_token(T)
        self.peak = device_peak_flops(self.device)
        self.stop = StopRequest()
        if self.dist.is_main:
            self.metrics.truncate_after(self.step)
            self.samples.truncate_after(self.step)
            with atomic_write(self.run_dir / "config.toml") as handle:
                header = f"kiln train config (fully resolved)\n{self.precision.describe()}"
                handle.write(cfgio.to_toml(self.cfg.to_dict(), header=header))

    # ---- the loop -------------------------------------------------------------------------------

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Stop after the current step, saving a checkpoint (what SIGINT and SIGTERM do)."""
        self.stop.ask(signum)

    def run(self) -> RunResult:
        """Train until the planned last step or a stop request; returns what this call did."""
        cfg = self.cfg
        result = RunResult(step=self.step, tokens=self.tokens)
        run_info = self._run_info()  # into the first metrics record; printed before the bar
        bar = progress_bar(cfg, self.step, self.max_steps, self.dist)
        window_tokens, window_time = 0, 0.0
        started, trained = self.clock(), self.train_seconds
        if self.dist.is_main:
            self.loggers = Loggers.open(cfg, self.run_dir, self.step)
        with (
            self.stop.caught(),
            contextlib.closing(bar) if bar else contextlib.nullcontext(),
            contextlib.closing(self.loggers),
        ):
            while self.step < self.max_steps and not self.stop.agreed(self.dist, self.device):
                t0 = self.clock()
                loss, grad_norm, lr = self._train_step()
                seconds = self._count_step_time(self.clock() - t0)
                window_time += seconds
                window_tokens += cfg.batch.global_tokens
                result.losses.append(loss)
                last = self._plan_next(bar)
                record = self._maybe_eval(last)
                if record or self.step % cfg.logging.every == 0 or last:
                    tps = window_tokens / window_time if window_time > 0 else 0.0
                    record = {
                        "step": self.step, "tokens": self.tokens, "loss": loss, "lr": lr,
                        "grad_norm": grad_norm, "tokens_per_s": tps,
                        "mfu": mfu(tps, self.flops_per_token, self.peak, self.dist.world_size),
                        "skipped_steps": self.skipped, "train_s": self.train_seconds,
                        "max_steps": self.max_steps, **run_info, **record,
                        **getattr(self, "expert_stats", {}),
                    }  # fmt: skip
                    window_tokens, window_time = 0, 0.0
                    run_info = {}
                    self._log(record, bar)
                    result.val_loss = record.get("val_loss", result.val_loss)
                if is_due(self.step, cfg.checkpoint.every, last):
                    result.checkpoint = self.save()
                if bar is not None:
                    bar.update(1)
                if self.on_step is not None:
                    self.on_step(self, self.step, loss)
        if self.stop.signal is not None and self.step < self.max_steps:
            result.interrupted, result.signal = True, self.stop.signal
            result.checkpoint = self.save()
        self.plan.finish()  # an async save is published before run() returns
        result.step, result.tokens = self.step, self.tokens
        if self.budget is not None:
            trained = self.train_seconds - trained
            other = max(0.0, self.clock() - started - trained)
            line = summary_line(self.budget, self.train_seconds, self.step, other)
            self.say(f"kiln train: {line}")
        return result

    def _run_info(self) -> dict[str, Any]:
        """What this call of `run` trains with, for the first metrics record and the log."""
        info: dict[str, Any] = {"precision": self.precision.to_dict()}
        if self.fp8["mode"] != "off":
            info["fp8"] = self.fp8
        if self.budget is not None:
            info["time_budget_s"] = self.budget.seconds
            line = intro_line(self.budget, self.cfg.train.max_steps, self.train_seconds)
            self.say(f"kiln train: {line}")
        return info

    def _count_step_time(self, seconds: float) -> float:
        """Add one step's time to the training clock (under torchrun: the ranks' mean).

        Every rank must plan the same steps, so a budgeted run agrees on each step's time.
        """
        if self.budget is not None and self.dist.world_size > 1:
            t = torch.tensor(seconds, dtype=torch.float64, device=self.device)
            seconds = distributed.mean_across_ranks(t, self.dist).item()
        self.train_seconds += seconds
        if self.budget is not None:
            self.budget.record(seconds)
        return seconds

    def _plan_next(self, bar: Any) -> bool:
        """Re-plan a budgeted run's length after a step; whether that step was the last one."""
        if self.budget is not None and self.step < self.max_steps:
            self.max_steps = self.budget.plan(self.step)
            note = self.budget.replan_note()
            if note is not None:
                self._tell(note)
            set_total(bar, self.max_steps)
        return self.step >= self.max_steps

    def _tell(self, line: str) -> None:
        """Rank 0: a line in the log that does not break the progress bar."""
        if self.dist.is_main:
            tqdm_write(f"kiln train: {line}")

    def _train_step(self) -> tuple[float, float, float]:
        """One optimizer step over `accum` micro-batches: (mean loss, grad norm, lr)."""
        cfg = self.cfg
        lr = set_lr(self.optimizer, lr_multiplier(cfg.schedule, self.step, self.max_steps))
        local = accumulate(self.train_model, self.loader, self.accum, self.precision, self.device)
        params = [p for p in self.model.parameters() if p.grad is not None]
        loss_value, norm = self.plan.loss_and_clip(local, params, cfg.train.grad_clip)
        grad_norm = float(norm)
        if math.isfinite(loss_value) and math.isfinite(grad_norm):
            self.optimizer.step()
        elif cfg.train.skip_nonfinite:
            self.skipped += 1
        else:
            latest = latest_checkpoint(self.checkpoints)
            raise NonFiniteError(nonfinite_message(self.step + 1, loss_value, grad_norm, latest))
        self.optimizer.zero_grad(set_to_none=True)
        self._balance_experts()
        self.step += 1
        self.tokens += cfg.batch.global_tokens
        return loss_value, grad_norm, lr

    def _balance_experts(self) -> None:
        """MoE: move the balancing biases, keep this step's expert loads for the metrics record."""
        self.expert_stats = balance_experts(
            self.model, lambda t: distributed.sum_across_ranks(t, self.dist)
        )
        dead = self.expert_stats.get("moe.dead_experts", 0)
        if dead and not getattr(self, "_warned_dead", False):
            self._warned_dead = True  # once per run: the load keeps appearing in metrics.jsonl
            self._tell(f"warning: {dead:.0f} expert(s) got no tokens at step {self.step + 1} "
                       "(dead experts; see moe.L*.load_min in metrics.jsonl)")  # fmt: skip

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's autocast: bf16 for matmuls (on CPU and CUDA), or nothing for fp32."""
        return autocast(self.precision, self.device)

    def evaluate(self) -> float | None:
        """Mean loss over the fixed val set, all ranks together (None when eval.batches is 0)."""
        if not self.val_batches:
            return None
        return val_loss(
            self.model, self.val_batches, self.val_windows, self.plan, self.precision, self.device
        )

    def _maybe_eval(self, last: bool) -> dict[str, float]:
        """{"val_loss": …} at eval steps (every eval.every steps, and the last), else {}.

        Rank 0 also writes the sampled continuations of these steps (see `sample`).
        """
        if not is_due(self.step, self.cfg.eval.every, last):
            return {}
        self.sample()
        value = self.evaluate()
        return {} if value is None else {"val_loss": value}

    def sample(self) -> list[dict[str, Any]]:
        """Rank 0: sampled continuations of the eval prompts, to samples.jsonl and the console.

        Drawn from a generator of their own with the global RNG state forked around them, so
        they change neither the training steps nor exact resume.
        """
        if self.sampler is None:
            return []
        records = self.sampler.sample(self.model, self.step)
        for record in records:
            self.samples.write(record)
            tqdm_write(format_sample(record))
        self.loggers.log_samples(self.step, records)
        return records

    def _log(self, record: dict[str, Any], bar: Any) -> None:
        """Append the record to metrics.jsonl and show it on the progress bar."""
        if not self.dist.is_main:
            return
        self.metrics.write(record)
        self.loggers.log(record)
        if bar is not None:
            show_record(bar, record)

    def save(self) -> Path:
        """Checkpoint the current step (once per step). Every rank takes part; rank 0 writes."""
        if self.step != self.last_saved:
            self.plan.save(
                self.checkpoints, self.model, self.optimizer, self._train_state(),
                self._scheduler_state(), self.cfg,
            )  # fmt: skip
            self.last_saved = self.step
        return step_dir(self.checkpoints, self.step)

    def _train_state(self) -> ckpt.TrainState:
        """What state.json records of this step (every rank's RNG states: the plan's save adds)."""
        return ckpt.TrainState(
            step=self.step,
            tokens=self.tokens,
            cursor=self.loader.cursor.to_dict(),
            config=self.cfg.to_dict(),
            dataset=self.data.fingerprint(),
            skipped_steps=self.skipped,
            rng=None,
            precision=self.precision.to_dict(),
            mup=mup_record(self.model_cfg, self.cfg.optim.name, self.cfg.optim.lr),
        )

    def _scheduler_state(self) -> dict[str, Any]:
        """The schedule as it stands: a budgeted run's plan and clock go on from here on resume."""
        return {
            **cfgio.to_dict(self.cfg.schedule),
            "max_steps": self.max_steps,
            "train_seconds": self.train_seconds,
            "time_budget_s": self.budget.seconds if self.budget is not None else None,
            "max_steps_cap": self.budget.cap if self.budget is not None else None,
        }
