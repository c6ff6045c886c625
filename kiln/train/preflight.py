"""Memory pre-flight: the peak memory each rank of a run will need, beside what its device has.

Built on accounting.py's whole-model figures, divided as the [parallel] mesh divides the work:

- parameters, gradients and optimizer state: the blocks of one pipeline stage (the largest),
  split over tp (their matrices) and over dp_shard (FSDP2 shards everything; dp_replicate
  copies do not divide), plus the embeddings and head on the stage that holds them;
- FSDP's gathered copies: one block unsharded for compute and the next prefetched, one block's
  unsharded gradients, and the root group (embeddings, head) while it runs;
- activations: the saved tensors of one micro-batch on this stage's blocks (every k-th block
  keeps only its input under activation checkpointing, one block is recomputed at a time),
  divided by tp, times the micro-batches in flight (1 without pipelining, all with GPipe, up to
  the number of stages with 1F1B), plus the loss's (whole logits on a pipeline's last stage).
  Mamba-2 and Gated DeltaNet layers count their own saved tensors (the chunked form's L×L
  matrices and the state entering each chunk, `accounting.recurrent_activation_bytes`), not an
  attention block's.

It is an estimate: allocator fragmentation, communication buffers and the CUDA context are not
counted (a margin is kept); bench/RESULTS.md compares it with measured peaks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from kiln.errors import KilnError
from kiln.model.accounting import (
    PRECISION_BYTES,
    activation_bytes,
    layer_activation_bytes,
    optimizer_state_bytes,
)
from kiln.model.config import ModelConfig
from kiln.train.config import TrainConfig

GIB = 2**30
MARGIN = 0.9  # of the device's capacity a run may plan to use


@dataclass(frozen=True)
class RankMemory:
    """Predicted peak bytes on the busiest rank, by part."""

    parameters: int
    gradients: int
    optimizer: int
    fsdp_gathered: int
    activations: int

    @property
    def total(self) -> int:
        """Every part together."""
        return (
            self.parameters + self.gradients + self.optimizer + self.fsdp_gathered
            + self.activations
        )  # fmt: skip

    def parts(self) -> dict[str, int]:
        """Name -> bytes, for the log."""
        return {
            "parameters": self.parameters, "gradients": self.gradients,
            "optimizer": self.optimizer, "fsdp gathered": self.fsdp_gathered,
            "activations": self.activations,
        }  # fmt: skip


def accounting_precision(dtype: str) -> str:
    """kiln train's dtype as accounting.py names it (bf16 autocast keeps fp32 weights)."""
    return "amp-bf16" if dtype == "bf16" else "fp32"


def in_flight(schedule: str, pp: int, microbatches: int) -> int:
    """Micro-batches whose activations a pipeline rank holds at once (1 without a pipeline)."""
    if pp == 1:
        return 1
    return microbatches if schedule == "gpipe" else min(microbatches, pp)


def rank_memory(
    model: ModelConfig,
    cfg: TrainConfig,
    shape: dict[str, int],
    dtype: str,
    micro_batch: int,
    microbatches: int = 1,
) -> RankMemory:
    """The peak of the busiest rank of a run of `cfg` on a mesh of `shape`, in `dtype`."""
    precision = accounting_precision(dtype)
    w, g, master = PRECISION_BYTES[precision]
    pp, tp, shard = shape["pp"], shape["tp"], shape["dp_shard"]
    parts = model.param_breakdown()
    per_block = (parts["attention"] + parts["mlp"] + parts["norms"]) // model.n_layer
    blocks_here = math.ceil(model.n_layer / pp)
    outside = parts["embeddings"] + parts["head"] + model.n_embd
    if pp > 1:  # the embeddings on the first stage, the head on the last: the larger of the two
        outside = max(parts["embeddings"], parts["head"] + model.n_embd)
    local = (blocks_here * per_block / tp + outside) / shard
    adam_per_param = optimizer_state_bytes(model, cfg.optim.name) / model.num_params()
    gathered = 0
    if shard > 1:
        gathered = int((2 * w + g) * per_block / tp + w * outside)
    T = cfg.data.seq_len
    tokens = micro_batch * T
    layers = [layer_activation_bytes(model, precision, i) * tokens for i in range(model.n_layer)]
    # A stage's blocks: the heaviest run of consecutive layers (hybrids mix mixer kinds)
    stage = max(sum(layers[i : i + blocks_here]) for i in range(0, model.n_layer, blocks_here))
    per_layer = max(layers)  # the block recomputed at a time under checkpointing
    whole = activation_bytes(model, micro_batch, T, precision)
    beyond_blocks = whole - sum(layers)  # embeddings, loss, weight copies
    par = cfg.parallel
    kept = 0
    if par.activation_checkpointing == "full":
        recomputed = len(range(0, blocks_here, par.ac_every))
        kept = recomputed * tokens * model.n_embd * 4 + (per_layer if recomputed else 0)
        kept += (blocks_here - recomputed) * stage / blocks_here
    else:
        kept = stage
    n = in_flight(par.pp_schedule, pp, microbatches)
    activations = n * kept / tp + beyond_blocks
    if pp > 1:  # the last stage's loss holds the logits and their gradient, fp32
        activations += 2 * 4 * tokens * model.vocab_size
    return RankMemory(
        parameters=int((w + master) * local),
        gradients=int(g * local),
        optimizer=int(adam_per_param * local),
        fsdp_gathered=gathered,
        activations=int(activations),
    )


def device_capacity(device: torch.device) -> tuple[int, str]:
    """(bytes one rank may use, what they are): a GPU's memory, or this host's free RAM shared
    by its local ranks."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"{props.name} memory"
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    free = psutil.virtual_memory().available
    return free // max(1, local), f"free RAM / {local} local rank(s)"


def check(
    model: ModelConfig,
    cfg: TrainConfig,
    shape: dict[str, int],
    dtype: str,
    device: torch.device,
    microbatches: int = 1,
) -> list[str]:
    """The pre-flight lines of a run on a mesh of `shape`; a clear error when it would not fit.

    The Trainer calls it before it allocates the model. With batch.micro_batch = "auto" the
    smallest micro-batch (1) is checked: the probe then finds the largest that fits.
    """
    micro = 1 if cfg.batch.micro_batch == "auto" else cfg.batch.micro_batch
    memory = rank_memory(model, cfg, shape, dtype, micro, microbatches)
    capacity, what = device_capacity(device)
    parts = ", ".join(f"{k} {size(v)}" for k, v in memory.parts().items() if v)
    mesh = " × ".join(f"{k}={shape[k]}" for k in ("pp", "dp_replicate", "dp_shard", "tp"))
    lines = [
        f"memory pre-flight ({mesh}): predicted peak {size(memory.total)} per rank "
        f"({parts}) of {size(capacity)} ({what})"
    ]
    if memory.total > MARGIN * capacity and cfg.train.memory_check:
        biggest = max(memory.parts().items(), key=lambda kv: kv[1])[0]
        advice = (
            "lower batch.micro_batch (global_tokens stays exact through accumulation) or set "
            "parallel.activation_checkpointing = 'full'"
            if biggest == "activations"
            else "shard more: raise parallel.dp_shard (more processes), parallel.tp or parallel.pp"
        )
        raise KilnError(
            f"{lines[0]}: the run would not fit ({biggest} is the largest part); {advice} "
            "(train.memory_check = false skips this check)"
        )
    return lines


def size(n: float) -> str:
    """Bytes as GiB (MiB below one GiB)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"
