"""On-policy distillation (GKD, Agarwal et al. 2024): the student samples, the teacher scores.

With `distill.on_policy = λ`, each micro-batch is on-policy with probability λ. Its windows keep
their first T - G tokens as a prompt (G = distill.gen_tokens) and the student, in eval mode and
without gradients, samples the last G tokens at distill.gen_temperature. Student and teacher then
both read the sampled sequence and the KL (distill.loss at distill.temperature) is taken over
the G positions that predict a sampled token; the cross-entropy term is not added there (its
targets would be the student's own samples). The other micro-batches are the dataset's windows
as usual (GKD's supervised / off-policy part).

Which micro-batches are on-policy and what is sampled are fixed by (train.seed, micro-step
index) alone, so a run is repeatable and a resumed run takes the same draws.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn


def draws(seed: int, micro: int, fraction: float) -> tuple[bool, int]:
    """(whether micro-step `micro` is on-policy, the torch seed of its samples)."""
    rng = np.random.default_rng([seed, micro, 0x6B6A])
    on, sample_seed = rng.random() < fraction, int(rng.integers(2**62))
    return bool(on), sample_seed


@torch.no_grad()
def sample_continuation(
    model: nn.Module, prompt: Tensor, n: int, temperature: float, vocab: int, seed: int
) -> Tensor:
    """prompt (B, P) followed by n tokens the model samples (greedy at temperature 0): (B, P + n).

    Only the first `vocab` logits are sampled from (a padded head's extra rows never are).
    """
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=prompt.device).manual_seed(seed)
    seq = prompt
    try:
        for _ in range(n):
            logits = model(seq)[:, -1, :vocab].float()  # (B, vocab)
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen)
            seq = torch.cat([seq, nxt], dim=1)
    finally:
        model.train(was_training)
    return seq


def generated_targets(seq: Tensor, prompt_len: int) -> Tensor:
    """Targets (B, T) for the sampled sequence: the sampled tokens where they are predicted, else -1.

    Position t predicts token t + 1, so positions prompt_len - 1 … T - 2 count.
    """
    targets = torch.full_like(seq, -1)
    targets[:, prompt_len - 1 : -1] = seq[:, prompt_len:]
    return targets
