"""`batch.micro_batch = "auto"`: the largest micro-batch that fits the GPU, found by a short probe.

The candidates are the divisors of the sequences each data-parallel rank reads per step
(global_tokens / (dp × seq_len)), largest first, so the global batch stays exact through
accumulation. Each is tried with one forward and backward on random tokens (its own generator,
the RNG state forked around it, gradients cleared after): it fits when that runs without running
out of memory and its peak plus the optimizer state still to come (AdamW: 8 bytes per local
parameter) stays under 90% of the device. CUDA only: on a CPU the memory is the host's and an
out-of-memory ends the process rather than raising, so a number must be given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.errors import KilnError
from kiln.train import distributed
from kiln.train.config import TrainConfig

HEADROOM = 0.9


def candidates(sequences_per_rank: int) -> list[int]:
    """Micro-batches that divide a rank's sequences per step, largest first."""
    return [b for b in range(sequences_per_rank, 0, -1) if sequences_per_rank % b == 0]


def largest_that_fits(sizes: list[int], fits: Callable[[int], bool]) -> int:
    """The first size for which `fits` is true (it returns False or raises OutOfMemoryError)."""
    for size in sizes:
        try:
            if fits(size):
                return size
        except torch.OutOfMemoryError:
            pass
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    raise KilnError(
        "batch.micro_batch = 'auto': not even a micro-batch of 1 fits this GPU; shard more "
        "(parallel.dp_shard, tp, pp) or set parallel.activation_checkpointing = 'full'"
    )


def probe(
    train_model: Callable[..., torch.Tensor],
    params: list[nn.Parameter],
    sequences_per_rank: int,
    seq_len: int,
    vocab_size: int,
    device: torch.device,
) -> int:
    """The largest micro-batch whose forward and backward fit the GPU `device` (see above)."""
    if device.type != "cuda":
        raise KilnError(
            f"batch.micro_batch = 'auto' probes GPU memory; on {device.type} give a number "
            "(e.g. batch.micro_batch = 8)"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    optimizer_bytes = 8 * sum(p.numel() for p in params)  # AdamW's two moments, not yet made
    generator = torch.Generator(device).manual_seed(0)

    def fits(size: int) -> bool:
        torch.cuda.reset_peak_memory_stats(device)
        with torch.random.fork_rng(devices=[device]):
            x = torch.randint(0, vocab_size, (size, seq_len), device=device, generator=generator)
            loss = train_model(x, x)
            loss.backward()
        for p in params:
            p.grad = None
        peak = torch.cuda.max_memory_allocated(device)
        return peak + optimizer_bytes < HEADROOM * total

    return largest_that_fits(candidates(sequences_per_rank), fits)


def resolve_auto(trainer: Any) -> TrainConfig:
    """A built Trainer's config with micro_batch "auto" replaced by the probed size (every rank
    takes the smallest any rank found)."""
    cfg = trainer.cfg
    T = cfg.data.seq_len
    per_rank = cfg.batch.global_tokens // (trainer.data_ranks * T)
    found = probe(
        trainer.train_model, list(trainer.model.parameters()), per_rank, T,
        trainer.model_cfg.vocab_size, trainer.device,
    )  # fmt: skip
    found = distributed.min_across_ranks(found, trainer.dist, trainer.device)
    trainer.say(f"kiln train: batch.micro_batch = 'auto' -> {found} (probed on {trainer.device})")
    return dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, micro_batch=found))
