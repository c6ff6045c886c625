"""Pipeline parallelism with torch.distributed.pipelining: the block stack cut into stages.

The blocks are cut into `pp × stages_per_rank` contiguous layer ranges balanced by parameter
count (the embeddings count towards the first stage, the final norm and head towards the last).
Pipeline rank r runs stages r, r + pp, ... (one with GPipe and 1F1B, two or more with
interleaved 1F1B). A stage is a `StageModule` holding the model's own submodules under their own
names (`blocks` is a ModuleDict keyed by the layer index), so parameter names, and so sharded
checkpoints, are the same as the unsplit model's. Each stage is then parallelised like a whole
model (tensor parallelism, activation checkpointing, compile, FSDP; parallelize.py).

One optimizer step is one pipeline step: the global batch's share of this data-parallel rank is
split by the schedule into micro-batches (global_tokens / (dp × micro_batch × seq_len) of them);
the last stage computes each micro-batch's loss (cross-entropy over the logits its head
produces, the model's soft-cap and z-loss included) and the schedule scales the gradients by
1 / micro-batches, so they are the mean's, as with gradient accumulation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from kiln.errors import KilnError
from kiln.model.loss import logits_loss
from kiln.model.transformer import Transformer
from kiln.train.config import TrainConfig
from kiln.train.parallelize import Mesh, parallelize_mesh


def balanced_ranges(
    weights: list[int], n_stages: int, first: int = 0, last: int = 0
) -> list[range]:
    """Contiguous ranges of `weights` (one per block) whose largest total is the smallest.

    `first` and `last` are extra weight carried by the first and the last stage.
    """
    n = len(weights)
    if n < n_stages:
        raise KilnError(
            f"{n_stages} pipeline stages need at least {n_stages} blocks; the model has {n} "
            "(lower parallel.pp or parallel.pp_stages_per_rank)"
        )
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(i: int, j: int, s: int) -> int:  # blocks i..j-1 as stage s
        return prefix[j] - prefix[i] + (first if s == 0 else 0) + (last if s == n_stages - 1 else 0)

    inf = float("inf")
    # best[s][j]: the smallest largest-stage cost of blocks 0..j-1 cut into s+1 stages
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, j, 0)
    for s in range(1, n_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], cost(i, j, s))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [n], n
    for s in range(n_stages - 1, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(n_stages)]


class StageModule(nn.Module):
    """Some consecutive blocks of a Transformer (with its embeddings first, its head last).

    It holds the model's own submodules under the model's names and runs them with the model's
    own code (`embed`, `run_blocks`, `head`): a stage computes what the same layers compute in
    the unsplit model, whatever the model's switches.
    """

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        object.__setattr__(
            self, "model", model
        )  # its code, not a submodule: names stay the model's
        self.layers, self.first, self.last = layers, first, last
        self.seq_shards = 1  # > 1 when sequence parallelism splits the hidden states on T
        if first:
            self.wte, self.drop = model.wte, model.drop
            if model.wpe is not None:
                self.wpe = model.wpe
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.norm_f, self.lm_head = model.norm_f, model.lm_head

    def forward(self, x: Tensor) -> Tensor:
        """Token ids (B, T) on the first stage, else hidden states -> hidden states or logits."""
        model: Transformer = self.model
        T = x.size(1) if self.first else x.size(1) * self.seq_shards
        pos = torch.arange(T, device=x.device)  # (T,)
        if self.first:
            x = model.embed(x, pos)  # (B, T, C)
        masks = model.attention_masks(pos, T, None, None)
        x = model.run_blocks(
            x, model.rope_at(pos), masks, None, self.layers.start, self.layers.stop
        )
        return model.head(x) if self.last else x  # (B, T, V) logits on the last stage


class RankModules(nn.Module):
    """This rank's stages as one module with the unsplit model's parameter names."""

    def __init__(self, stages: list[StageModule]) -> None:
        super().__init__()
        self.cfg = stages[0].model.cfg  # the optimizer reads it (µP's per-role learning rates)
        self.blocks = nn.ModuleDict()
        for stage in stages:
            for name, child in stage.named_children():
                if name == "blocks":
                    self.blocks.update(child)
                else:
                    setattr(self, name, child)


class PipelineRunner:
    """Runs one pipeline step (forward and backward of every micro-batch) on this rank."""

    def __init__(self, schedule: Any, has_first: bool, has_last: bool) -> None:
        self.schedule = schedule
        self.has_first, self.has_last = has_first, has_last

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        """The mean micro-batch loss on the rank with the last stage (0 elsewhere), detached."""
        losses: list[Tensor] = []
        args = (x,) if self.has_first else ()
        kwargs = {"target": y, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        if not self.has_last:
            return torch.zeros((), device=x.device)
        return torch.stack([loss.detach().float() for loss in losses]).mean()


def _schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    return {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved_1f1b": ScheduleInterleaved1F1B,
    }[name]


def stages_per_rank(cfg: TrainConfig) -> int:
    """Stages on each pipeline rank: parallel.pp_stages_per_rank, or 2 for interleaved 1F1B."""
    par = cfg.parallel
    n = par.pp_stages_per_rank or (2 if par.pp_schedule == "interleaved_1f1b" else 1)
    if par.pp_schedule != "interleaved_1f1b" and n != 1:
        raise KilnError(
            f"parallel.pp_stages_per_rank = {n} needs pp_schedule = 'interleaved_1f1b' "
            f"(got {par.pp_schedule!r})"
        )
    return n


def release_others(model: Transformer, layers: list[range], first: bool, last: bool) -> None:
    """Free the model's parts that other pipeline ranks run (to the meta device, in place).

    The stages run the model's own code, so it stays; its weights elsewhere need no memory here.
    """
    kept = {i for r in layers for i in r}
    for i, block in enumerate(model.blocks):
        if i not in kept:
            block.to("meta")
    outer = ([] if first else [model.wte, model.wpe]) + ([] if last else [model.lm_head])
    for module in outer:
        if module is not None:
            module.to("meta")


def build_pipeline(
    model: Transformer, cfg: TrainConfig, mesh: Mesh, microbatches: int
) -> tuple[nn.Module, PipelineRunner]:
    """(this rank's stages as one module, the runner of one pipeline step)."""
    from torch.distributed.pipelining import PipelineStage

    if model.cfg.tie_embeddings:
        raise KilnError(
            "parallel.pp > 1 needs model.tie_embeddings = false (the embedding and the head "
            "live on different stages)"
        )
    if cfg.eval.batches:
        raise KilnError(
            "eval with parallel.pp > 1 is not supported yet; set eval.batches = 0 and evaluate "
            "a checkpoint"
        )
    pp, per_rank = mesh.size("pp"), stages_per_rank(cfg)
    n_stages = pp * per_rank
    if microbatches < n_stages and cfg.parallel.pp_schedule != "gpipe":
        raise KilnError(
            f"{microbatches} micro-batches for {n_stages} pipeline stages: a {cfg.parallel.pp_schedule} "
            "schedule needs at least one per stage (lower batch.micro_batch or raise "
            "batch.global_tokens)"
        )
    sizes = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    head = sum(p.numel() for p in model.norm_f.parameters()) + model.lm_head.weight.numel()
    embed = model.wte.weight.numel() + (model.wpe.weight.numel() if model.wpe is not None else 0)
    ranges = balanced_ranges(sizes, n_stages, embed, head)
    rank = mesh.rank("pp")
    mine = [rank + k * pp for k in range(per_rank)]
    device = model.wte.weight.device
    stages, modules = [], []
    for index in mine:
        module = StageModule(model, ranges[index], index == 0, index == n_stages - 1)
        parallelize_mesh(module, cfg, mesh)
        modules.append(module)
        stages.append(
            PipelineStage(module, index, n_stages, device, group=mesh.sub("pp").get_group())
        )
    release_others(model, [ranges[i] for i in mine], 0 in mine, n_stages - 1 in mine)
    z = model.cfg.z_loss

    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        return logits_loss(logits, targets, z)

    kind = _schedule_class(cfg.parallel.pp_schedule)
    schedule = kind(stages if per_rank > 1 or kind.__name__.startswith("ScheduleInterleaved") else stages[0],
                    n_microbatches=microbatches, loss_fn=loss_fn)  # fmt: skip
    runner = PipelineRunner(schedule, 0 in mine, n_stages - 1 in mine)
    return RankModules(modules), runner
