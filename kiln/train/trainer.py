"""The training loop: gradient accumulation, clipping, autocast, eval, checkpoints, exact resume.

One optimizer step consumes `batch.global_tokens` tokens: `accum` micro-steps, each reading the
next `world_size · micro_batch` windows of the loader's stream (this rank's slice of them). The
loss of each micro-step is divided by `accum` so the accumulated gradient is that of the mean.

Everything that decides the next step (weights, optimizer state, loader cursor, RNG states,
step) is in a checkpoint, and the lr is a pure function of the step, so a resumed run takes the
same steps as an uninterrupted one (bit for bit on the CPU). A resumed `dtype = "auto"` run keeps
the precision its checkpoint was trained in, even on a machine that would choose the other.

The run's length is train.max_steps, or a plan that train.time_budget re-makes before every step
from the measured step time (kiln/train/budget.py); the training seconds so far are in each
checkpoint, so a resumed budgeted run ends at the same total budget.

Parallelism is applied from outside the model (torchtitan style): `parallelize(model, cfg,
dist)` returns the module to train (DDP/FSDP wrapping and compile go there; see distributed.py).
The loop only asks the wrapped module to skip gradient synchronisation on the non-final
micro-steps when it can (DDP's `no_sync()`, FSDP2's `set_requires_gradient_sync`). A
[parallel] mesh run (tp, pp, HSDP; parallelize.py) reads its batch slice by data-parallel
rank, sums losses and norms over the mesh's groups, runs a pipeline step in place of the
micro-steps (pipeline.py) and saves sharded checkpoints (sharded_checkpoint.py).

Under torchrun every rank runs this same loop on its slice of each global batch. The numbers a
user sees are global: the logged loss is the mean over ranks, the gradient norm is that of the
whole (synchronised or sharded) gradient, the val loss is over one fixed val set split across
ranks. Every rank takes part in each checkpoint (sharded tensors and per-rank RNG states are
gathered to rank 0); only rank 0 writes files.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln import config as cfgio
from kiln.data import LoaderCursor
from kiln.devices import Precision, choose_precision, resolve_device
from kiln.errors import KilnError
from kiln.folders import lock_folder
from kiln.io import atomic_write
from kiln.model import ModelConfig, Transformer
from kiln.model.moe import balance_experts
from kiln.train import checkpoint as ckpt
from kiln.train import distributed
from kiln.train import parallelize as mesh_ops
from kiln.train import sharded_checkpoint as sharded
from kiln.train.budget import TimeBudget, format_seconds
from kiln.train.config import TrainConfig
from kiln.train.distributed import DistInfo
from kiln.train.loggers import Loggers, check_backends
from kiln.train.metrics import MetricsLog, device_peak_flops, mfu
from kiln.train.mup import apply_mup_init, mup_record
from kiln.train.optim import build_optimizer, set_lr
from kiln.train.samples import ContinuationSampler, format_sample
from kiln.train.schedule import lr_multiplier
from kiln.train.sources import TokenShards, TrainData


class NonFiniteError(KilnError):
    """The loss or gradient norm of a step was NaN or infinite."""


__all__ = ["DistInfo", "NonFiniteError", "RunResult", "Trainer", "accumulation_steps"]

Parallelize = Callable[[nn.Module, TrainConfig, DistInfo], nn.Module]


def accumulation_steps(global_tokens: int, world_size: int, micro_batch: int, seq_len: int) -> int:
    """Micro-steps per optimizer step; the global batch must split exactly into micro-batches."""
    per_micro = world_size * micro_batch * seq_len
    if global_tokens % per_micro:
        lower = max(per_micro, global_tokens // per_micro * per_micro)
        raise KilnError(
            f"batch.global_tokens ({global_tokens}) must be a multiple of data-parallel ranks × "
            f"batch.micro_batch × data.seq_len = {world_size} × {micro_batch} × {seq_len} = "
            f"{per_micro}; use e.g. {lower} or {lower + per_micro}"
        )
    return global_tokens // per_micro


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
        parallelize: Parallelize = distributed.parallelize,
        on_step: Callable[[Trainer, int, float], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        data: TrainData | None = None,
        prepare_model: Callable[[Transformer], None] | None = None,
    ) -> None:
        # `data`: the batches (default: cfg.data.dataset's token shards); `prepare_model` edits
        # the freshly initialised model before it is wrapped and optimised (post-training loads
        # its base weights and adds adapters there; only parameters that require grad are
        # optimised).
        # No DistInfo given: torchrun's environment says (rank 0 of 1 without torchrun).
        self.dist = dist or DistInfo.from_env()
        self.run_dir = Path(run_dir)
        self.checkpoints = self.run_dir / "checkpoints"
        self.on_step = on_step
        self.clock = clock  # times the training steps (a test passes a fake one)
        self.say = print if self.dist.is_main else _silent
        self.device = resolve_device(cfg.train.device, self.dist.local_rank)
        distributed.join_from_env(self.device, self.dist)
        self.data = data if data is not None else TokenShards(cfg.data.dataset)
        self.model_cfg: ModelConfig = cfg.model_config(self.data.vocab_size)
        self.cfg = cfg.resolved(self.model_cfg)
        self.notes: list[str] = []  # what a resume changed, for the CLI to print
        check_backends(self.cfg)  # on every rank: a missing package fails everywhere, at once
        self.sampler = self._build_sampler()  # bad sample prompts fail before the run dir exists
        saved = self._find_resume_point(resume)
        # The [parallel] mesh (parallelize.py), or None for one process / 1-D DDP or FSDP.
        self.mesh = self._build_mesh(saved)
        self.data_rank, self.data_ranks = (
            (self.mesh.dp_rank, self.mesh.dp_size)
            if self.mesh is not None
            else (self.dist.rank, self.dist.world_size)
        )
        auto_micro = cfg.batch.micro_batch == "auto"  # probed once the model is built
        if auto_micro and self.mesh is not None and self.mesh.size("pp") > 1:
            raise KilnError("batch.micro_batch = 'auto' is not supported with parallel.pp > 1")
        self.accum = accumulation_steps(
            cfg.batch.global_tokens, self.data_ranks, 1 if auto_micro else cfg.batch.micro_batch,
            cfg.data.seq_len,
        )  # fmt: skip
        self.precision = self._choose_precision(saved)
        if self.dist.is_main:  # what a killed run left: temp/trash folders, an unfinished prune
            # Held while this Trainer lives (the OS drops it if the process dies): a second
            # trainer on this folder would delete the live run's temp files in its tidy.
            self._run_lock = lock_folder(self.run_dir, "kiln train", "run folder")
            self.notes += ckpt.tidy(self.checkpoints, cfg.checkpoint.keep_last if saved else None)

        if self.device.type == "cuda":  # TF32 matmuls: fp32 range, ~10-bit mantissa, far faster
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(cfg.train.seed)
        self.model = Transformer(self.model_cfg).to(self.device)
        apply_mup_init(self.model)  # µP's init when model.mup_base_width is set (else no-op)
        if prepare_model is not None:
            prepare_model(self.model)
        # torchtitan's order: parallelize (FSDP2 shards the parameters in place), then build the
        # optimizer over the parameters as they now are, then load a checkpoint into both.
        if self.mesh is not None:  # self.model: this rank's part (a pipeline stage's modules)
            self.model, self.train_model = mesh_ops.parallelize_for_mesh(
                self.model, self.cfg, self.mesh, self.accum
            )
            if self.mesh.size("pp") > 1:  # the accumulation steps become pipeline micro-batches
                self.pipeline_microbatches, self.accum = self.accum, 1
        else:
            self.train_model = parallelize(self.model, self.cfg, self.dist)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        if auto_micro:  # the largest that fits, by a probe on the GPU
            from kiln.train.micro_batch import resolve_auto

            cfg = self.cfg = resolve_auto(self)
            self.accum = accumulation_steps(
                cfg.batch.global_tokens, self.data_ranks, cfg.batch.micro_batch, cfg.data.seq_len
            )
        _seed_rank(cfg.train.seed, self.dist.rank)
        self.step, self.tokens, self.skipped = 0, 0, 0
        self.train_seconds = 0.0  # training time so far (eval, samples, checkpoints excluded)
        planned: int | None = None  # a budgeted run's saved plan of max_steps
        cursor = LoaderCursor()
        if saved is not None:
            path, state = saved
            if self.mesh is not None:
                sharded.load(path, self.model, self.optimizer)
            else:
                ckpt.load_weights(path, self.model, self.optimizer, self.device)
            self.step, self.tokens = state["step"], state["tokens"]
            self.skipped = state.get("skipped_steps", 0)
            schedule = state["scheduler"]
            self.train_seconds = float(schedule.get("train_seconds", 0.0))
            same = (schedule.get("time_budget_s"), schedule.get("max_steps_cap"))
            if same == (cfg.train.budget_seconds, cfg.train.max_steps):
                planned = schedule.get("max_steps")  # else a new budget or cap: plan afresh
            cursor = LoaderCursor.from_dict(state["cursor"])
            rng = state["rng"].get(str(self.dist.rank))
            if rng is not None:
                ckpt.restore_rng(rng)
            else:  # resumed on more ranks than saved it: a fresh, distinct stream for this one
                _seed_rank(cfg.train.seed + 1_000_003 * self.step, self.dist.rank)
                self.notes.append(
                    f"rank {self.dist.rank}: no RNG state in {path.name} (saved by "
                    f"{len(state['rng'])} rank(s)); reseeded"
                )
        self.last_saved = self.step if saved is not None else -1
        budget = self.cfg.train.budget_seconds
        self.budget = (
            None
            if budget is None
            else TimeBudget(budget, self.cfg.train.max_steps, self.train_seconds, planned)
        )
        # The schedule's length: fixed, or the budget's plan (re-made after every step).
        self.max_steps: int = (
            self.cfg.train.max_steps if self.budget is None else self.budget.plan(self.step)
        )
        B, T, W = cfg.batch.micro_batch, cfg.data.seq_len, self.data_ranks
        if self.mesh is not None and self.mesh.size("pp") > 1:
            B *= self.pipeline_microbatches  # one pipeline step reads them all
        self.loader = self.data.loader("train", T, W * B, cfg.data.seed, cursor, self.data_rank, W)
        self.val_batches = self._val_batches() if cfg.eval.batches > 0 else []
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.samples = MetricsLog(self.run_dir / "samples.jsonl")  # {"step", "prompt", "text"}
        self.loggers = Loggers([])  # the TensorBoard / W&B backends, opened by run() on rank 0
        self.flops_per_token = self.model_cfg.flops_per_token(T)
        self.peak = device_peak_flops(self.device)
        self._stop_signal: int | None = None
        if self.dist.is_main:
            self.metrics.truncate_after(self.step)
            self.samples.truncate_after(self.step)
            with atomic_write(self.run_dir / "config.toml") as handle:
                header = f"kiln train config (fully resolved)\n{self.precision.describe()}"
                handle.write(cfgio.to_toml(self.cfg.to_dict(), header=header))

    # ---- setup ----------------------------------------------------------------------------------

    def _find_resume_point(self, resume: bool) -> tuple[Path, dict[str, Any]] | None:
        """The checkpoint to resume from (checked against this config), or None for a fresh run."""
        latest = ckpt.resume_checkpoint(self.checkpoints)  # tidy() rewrites a lost `latest`
        if not resume:
            if latest is not None or ckpt.list_checkpoints(self.checkpoints):
                raise KilnError(
                    f"{self.checkpoints} already holds checkpoints; pass --resume to continue "
                    "that run, or set logging.run_dir to start a new one"
                )
            return None
        if latest is None:
            raise KilnError(f"nothing to resume: {self.checkpoints} has no checkpoint")
        state = ckpt.read_state(latest)
        saved, now = state["config"], self.cfg.to_dict()
        # The data is identified by its contents, so a dataset that moved may still resume.
        fixed = ckpt.config_differences(
            {"model": saved["model"], "data": {**saved["data"], "dataset": None},
             "dataset": state["dataset"]},
            {"model": now["model"], "data": {**now["data"], "dataset": None},
             "dataset": self.data.fingerprint()},
        )  # fmt: skip
        if fixed:
            raise KilnError(
                f"cannot resume from {latest}: the model or data changed "
                f"({'; '.join(fixed)}); restore it or start a new run in another logging.run_dir"
            )
        self.notes = ckpt.config_differences(saved, now)
        return latest, state

    def _build_mesh(self, saved: tuple[Path, dict[str, Any]] | None) -> mesh_ops.Mesh | None:
        """The [parallel] mesh when the run uses one (a sharded checkpoint needs one), else None."""
        mode = distributed.parallel_mode(self.cfg, self.dist)
        if saved is not None and sharded.is_sharded_checkpoint(saved[0]) and mode != "mesh":
            raise KilnError(
                f"{saved[0]} is a sharded checkpoint: resume it with train.parallel = 'mesh' "
                "(on any mesh shape or number of processes)"
            )
        if mode != "mesh":
            return None
        mesh = mesh_ops.build_mesh(self.cfg, self.dist.world_size, self.device)
        self.say(f"kiln train: {mesh.describe()}")
        return mesh

    def _choose_precision(self, saved: tuple[Path, dict[str, Any]] | None) -> Precision:
        """train.dtype resolved for this device, said once; a resumed "auto" keeps its dtype.

        Every rank must train in the same dtype: where any rank's "auto" falls back to fp32
        (its probe disagreed), all do.
        """
        requested = self.cfg.train.dtype
        precision = choose_precision(requested, self.device)
        if requested == "auto":
            fp32 = distributed.any_rank(precision.name == "fp32", self.dist, self.device)
            if fp32 and precision.name != "fp32":
                precision = Precision("fp32", requested, "another rank's probe chose fp32")
        kept = _saved_precision(saved[1]) if saved is not None else {}
        if requested == "auto" and kept.get("dtype") not in (None, precision.name):
            slowdown = None
            if kept["dtype"] == "bf16" and self.device.type == "cpu":
                slowdown = choose_precision("bf16", self.device).bf16_slowdown
            precision = Precision(
                kept["dtype"],
                requested,
                f"kept from {saved[0].name} so the resumed run trains as it began (this machine "
                f"alone would pick {precision.name}: {precision.reason}; set "
                f"train.dtype={precision.name} to switch)",
                slowdown,
            )
        for line in precision.lines("kiln train"):
            self.say(line)
        return precision

    def _build_sampler(self) -> ContinuationSampler | None:
        """The eval-step sampler on rank 0, or None (sampling off, FSDP, or no tokenizer).

        Rank 0 decodes alone with the unwrapped model, which needs every weight on rank 0: with
        FSDP each rank holds a shard (and every rank would have to join each decode step's
        forward), so samples are skipped there, with one warning.
        """
        ev = self.cfg.eval
        if not self.dist.is_main or ev.sample_tokens <= 0 or not ev.sample_prompts:
            return None
        mode = distributed.parallel_mode(self.cfg, self.dist)
        if mode == "fsdp" or (mode == "mesh" and self.dist.world_size > 1):
            warnings.warn(
                f"eval samples skipped: not supported with train.parallel = {mode!r} (sample from "
                "a checkpoint instead, or set eval.sample_tokens = 0 to silence this)",
                stacklevel=3,
            )
            return None
        return self.data.sampler(ev, self.cfg.train.seed)

    def _val_batches(self) -> list[tuple[Any, ...]]:
        """This rank's part of the fixed val set, as (inputs, targets, windows that count, *extra).

        The val set is the first `eval.batches` batches of `micro_batch` windows of the val
        stream whatever the world size, so val losses compare across world sizes. Rank r takes
        the r-th of W near-equal slices and reads it in as many forward passes as the largest
        slice needs: every rank runs the same number of passes (FSDP gathers weights in each),
        and a pass with nothing left for this rank reuses a window with weight 0.
        """
        T, B, W = self.cfg.data.seq_len, self.cfg.batch.micro_batch, self.data_ranks
        size = min(B, self.data.val_rows(T))  # a small val split: smaller batches
        loader = self.data.loader("val", T, size, self.cfg.data.seed)
        batches = [loader.next_batch().to_torch() for _ in range(self.cfg.eval.batches)]
        x, y, *extra = (torch.cat(column) for column in zip(*batches, strict=True))  # (N, T)
        mine = np.array_split(np.arange(len(x)), W)[self.data_rank]
        passes = max(1, math.ceil(math.ceil(len(x) / W) / B))
        out = []
        for rows in np.array_split(mine, passes):
            weight = len(rows)
            rows = rows if weight else np.array([0])  # nothing left: a pass that counts 0
            x_rows, y_rows, *more = (t[rows].to(self.device) for t in (x, y, *extra))
            out.append((x_rows, y_rows, weight, *more))
        self.val_windows = len(x)
        return out

    # ---- the loop -------------------------------------------------------------------------------

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Stop after the current step, saving a checkpoint (what SIGINT and SIGTERM do)."""
        self._stop_signal = signum

    def _stop_requested(self) -> bool:
        """Whether any rank was asked to stop: all must stop at the same step, or they hang."""
        asked = distributed.any_rank(self._stop_signal is not None, self.dist, self.device)
        if asked and self._stop_signal is None:
            self._stop_signal = signal.SIGTERM  # another rank's signal (torchrun forwards TERM)
        return asked

    def run(self) -> RunResult:
        """Train until the planned last step or a stop request; returns what this call did."""
        cfg = self.cfg
        result = RunResult(step=self.step, tokens=self.tokens)
        run_info = self._run_info()  # into the first metrics record; printed before the bar
        bar = _progress(cfg, self.step, self.max_steps, self.dist)
        window_tokens, window_time = 0, 0.0
        started, trained = self.clock(), self.train_seconds
        if self.dist.is_main:
            self.loggers = Loggers.open(cfg, self.run_dir, self.step)
        with (
            self._signals_caught(),
            contextlib.closing(bar) if bar else contextlib.nullcontext(),
            contextlib.closing(self.loggers),
        ):
            while self.step < self.max_steps and not self._stop_requested():
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
                every = cfg.checkpoint.every
                if last or (every and self.step % every == 0):
                    result.checkpoint = self.save()
                if bar is not None:
                    bar.update(1)
                if self.on_step is not None:
                    self.on_step(self, self.step, loss)
        if self._stop_signal is not None and self.step < self.max_steps:
            result.interrupted, result.signal = True, self._stop_signal
            result.checkpoint = self.save()
        if self.mesh is not None:
            sharded.finish_pending(self.dist)  # an async save is published before run() returns
        result.step, result.tokens = self.step, self.tokens
        if self.budget is not None:
            trained = self.train_seconds - trained
            other = max(0.0, self.clock() - started - trained)
            self.say(
                f"kiln train: time budget: {format_seconds(self.train_seconds)} of "
                f"{format_seconds(self.budget.seconds)} trained, {self.step:,} steps "
                f"(evaluation, sampling and checkpoints took {format_seconds(other)} more, "
                "not counted)"
            )
        return result

    def _run_info(self) -> dict[str, Any]:
        """What this call of `run` trains with, for the first metrics record and the log."""
        info: dict[str, Any] = {"precision": self.precision.to_dict()}
        if self.budget is not None:
            info["time_budget_s"] = self.budget.seconds
            cap = f", at most {self.cfg.train.max_steps:,} steps" if self.budget.cap else ""
            done = (
                f"; {format_seconds(self.train_seconds)} already trained"
                if self.train_seconds
                else ""
            )
            self.say(
                f"kiln train: time budget {format_seconds(self.budget.seconds)} of training"
                f"{cap}{done}: steps are planned from the measured step time so the lr schedule "
                "ends on time (evaluation, sampling and checkpoints are not counted)"
            )
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
            if bar is not None and bar.total != self.max_steps:
                bar.total = self.max_steps
                bar.refresh()
        return self.step >= self.max_steps

    def _tell(self, line: str) -> None:
        """Rank 0: a line in the log that does not break the progress bar."""
        if self.dist.is_main:
            tqdm_write(f"kiln train: {line}")

    def _train_step(self) -> tuple[float, float, float]:
        """One optimizer step over `accum` micro-batches: (mean loss, grad norm, lr)."""
        cfg = self.cfg
        lr = set_lr(self.optimizer, lr_multiplier(cfg.schedule, self.step, self.max_steps))
        total = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            # (B, T) each; post-training's packed rows add their segment ids
            x, y, *extra = self.loader.next_batch().to_torch(self.device)
            with self._grad_sync(micro == self.accum - 1), self._autocast():
                loss = self.train_model(x, y, *extra)
            if loss.requires_grad:  # a pipeline step has run its own backward
                (loss / self.accum).backward()
            total += loss.detach()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.mesh is not None:  # sums and norms over the mesh's own groups
            loss_value, norm = mesh_ops.loss_and_clip(
                total / self.accum, params, cfg.train.grad_clip, self.mesh
            )
        else:
            loss_value = distributed.mean_across_ranks(total / self.accum, self.dist).item()
            # clip_grad_norm_ in two steps: a sharded gradient's norm is a DTensor whose global
            # value full_tensor() reduces over the ranks; clipping then scales every shard alike.
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, cfg.train.grad_clip, norm)
        grad_norm = float(norm)
        if math.isfinite(loss_value) and math.isfinite(grad_norm):
            self.optimizer.step()
        elif cfg.train.skip_nonfinite:
            self.skipped += 1
        else:
            raise NonFiniteError(self._nonfinite_message(loss_value, grad_norm))
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

    def _nonfinite_message(self, loss: float, grad_norm: float) -> str:
        """Why the run stopped and where to go on from."""
        latest = ckpt.latest_checkpoint(self.checkpoints)
        where = (
            f"the last good checkpoint is {latest} (continue with --resume)"
            if latest is not None
            else "no checkpoint was saved yet"
        )
        return (
            f"step {self.step + 1}: non-finite loss {loss} or gradient norm {grad_norm}; "
            f"stopped without updating the weights, {where}. Lower optim.lr or train.grad_clip, "
            "or set train.skip_nonfinite = true to skip such steps"
        )

    def _grad_sync(self, last_micro: bool) -> contextlib.AbstractContextManager[Any]:
        """Synchronise gradients on the last micro-step only, where the module can (DDP, FSDP2)."""
        set_sync = getattr(self.train_model, "set_requires_gradient_sync", None)
        if set_sync is not None:  # FSDP2: a flag read by the next backward
            set_sync(last_micro)
            return contextlib.nullcontext()
        no_sync = getattr(self.train_model, "no_sync", None)
        return contextlib.nullcontext() if last_micro or no_sync is None else no_sync()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 autocast for matmuls (on CPU and CUDA), or nothing for fp32."""
        enabled = self.precision.name == "bf16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the fixed val set, all ranks together (None when eval.batches is 0)."""
        if not self.val_batches:
            return None
        self.model.eval()
        total = torch.zeros((), device=self.device)
        # Every window has T targets: weigh by windows (post-training rows add segment ids).
        for x, y, weight, *extra in self.val_batches:
            with self._autocast():
                total += self.model(x, y, *extra).float() * weight
        self.model.train()
        if self.mesh is not None:
            return mesh_ops.loss_ranks_sum(total, self.mesh) / self.val_windows
        return (distributed.sum_across_ranks(total, self.dist) / self.val_windows).item()

    def _maybe_eval(self, last: bool) -> dict[str, float]:
        """{"val_loss": …} at eval steps (every eval.every steps, and the last), else {}.

        Rank 0 also writes the sampled continuations of these steps (see `sample`).
        """
        every = self.cfg.eval.every
        if not (last or (every and self.step % every == 0)):
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
            shown = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
            if record["mfu"] is not None:
                shown["mfu"] = f"{100 * record['mfu']:.1f}%"
            if "val_loss" in record:
                shown["val"] = f"{record['val_loss']:.4f}"
            bar.set_postfix(shown, refresh=False)

    def save(self) -> Path:
        """Checkpoint the current step (once per step). Every rank takes part; rank 0 writes."""
        if self.step == self.last_saved:
            return ckpt.step_dir(self.checkpoints, self.step)
        if self.mesh is not None:  # every rank writes its own shards (sharded_checkpoint.py)
            path = sharded.save(
                self.checkpoints, self.model, self.optimizer, self._train_state([]),
                self._scheduler_state(), self.cfg.checkpoint.keep_last, self.dist,
                self.cfg.parallel.async_checkpoint,
            )  # fmt: skip
            self.last_saved = self.step
            return path
        # Collectives first, in the same order on every rank; then rank 0 writes alone.
        tensors = ckpt.full_model_state(self.model, self.dist.is_main)
        optim_state = ckpt.full_optimizer_state(self.optimizer)
        rngs = distributed.gather_to_main(ckpt.capture_rng(), self.dist)
        path = ckpt.step_dir(self.checkpoints, self.step)
        if self.dist.is_main:
            assert rngs is not None
            path = self._write_checkpoint(tensors, optim_state, rngs)
        distributed.barrier(self.dist)  # nobody goes on (or reads `latest`) before it exists
        self.last_saved = self.step
        return path

    def _write_checkpoint(
        self, tensors: dict[str, torch.Tensor], optim_state: dict[str, Any], rngs: list[Any]
    ) -> Path:
        """Write the gathered state as the checkpoint of this step (the main process only)."""
        state = self._train_state(rngs)
        return ckpt.save_checkpoint(
            self.checkpoints, tensors, optim_state, state, self._scheduler_state(),
            self.cfg.checkpoint.keep_last,
        )  # fmt: skip

    def _train_state(self, rngs: list[Any]) -> ckpt.TrainState:
        """What state.json records of this step (`rngs`: every rank's RNG states, in order)."""
        return ckpt.TrainState(
            step=self.step,
            tokens=self.tokens,
            cursor=self.loader.cursor.to_dict(),
            config=self.cfg.to_dict(),
            dataset=self.data.fingerprint(),
            skipped_steps=self.skipped,
            rng={str(rank): rng for rank, rng in enumerate(rngs)},
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

    @contextlib.contextmanager
    def _signals_caught(self) -> Iterator[None]:
        """SIGINT/SIGTERM ask for a stop after the current step; a second SIGINT stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return

        def handler(signum: int, frame: Any) -> None:
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.request_stop(signum)

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def _saved_precision(state: dict[str, Any]) -> dict[str, Any]:
    """The precision a checkpoint was trained in (older ones name it in their config only)."""
    if state.get("precision"):
        return state["precision"]
    dtype = state["config"].get("train", {}).get("dtype", "bf16")  # bf16: the old default
    return {"dtype": dtype} if dtype != "auto" else {}


def _seed_rank(seed: int, rank: int) -> None:
    """Seed Python and NumPy (and torch past rank 0) for this rank: one state per rank.

    Rank 0's torch stream goes on from the model's initialisation, as with one process; the
    other ranks get their own, so dropout masks differ between ranks. Seeding Python and NumPy
    too makes every saved RNG state a function of the config, not of the process.
    """
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    if rank:
        torch.manual_seed(seed + rank)


def tqdm_write(line: str) -> None:
    """Print a line without breaking a progress bar."""
    from tqdm import tqdm

    tqdm.write(line)


def _silent(*args: Any, **kwargs: Any) -> None:
    """print's stand-in on ranks other than the main one."""


def _progress(cfg: TrainConfig, step: int, total: int, dist: DistInfo) -> Any:
    """A tqdm bar over the steps (with loss, tokens/s, MFU and its own ETA), or None."""
    if not (cfg.logging.progress and dist.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=step, unit="step", dynamic_ncols=True)
