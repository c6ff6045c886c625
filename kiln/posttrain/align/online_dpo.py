"""Online (iterative) DPO: every `resample_every` steps the pairs are re-made from the current
policy's own replies, judged by the task checks, so the policy learns from the mistakes it makes
now rather than from those of the model that wrote the pairs file (Xu et al. 2023, "Some things
are more CRINGE than others"; Guo et al. 2024, "Direct Language Model Alignment from Online AI
Feedback"; Pang et al. 2024's iterative RPO).

Each re-made set is written to `online_pairs/step_N.jsonl` in the run folder before it is used,
so a resumed run trains on exactly the pairs an uninterrupted one would have (they depend on the
policy's weights at step N, which a later checkpoint no longer holds).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kiln.io import atomic_write
from kiln.model.transformer import Transformer
from kiln.posttrain.align.dpo import DPOConfig, DPOTrainer, TokenPair
from kiln.posttrain.align.loop import epoch_slice
from kiln.posttrain.align.preferences import SamplingConfig, build_pairs, tokenize_pair
from kiln.tokenizer.tokenizer import Tokenizer

PAIRS_DIR = "online_pairs"


class OnlineDPOTrainer(DPOTrainer):
    """DPOTrainer whose pairs are re-sampled from the policy every cfg.resample_every steps."""

    def __init__(
        self,
        policy: Transformer,
        pairs: Sequence[TokenPair],
        cfg: DPOConfig,
        out_dir: Path,
        *,
        records: Sequence[Mapping[str, Any]],
        tokenizer: Tokenizer,
        **kwargs: Any,
    ) -> None:
        super().__init__(policy, pairs, cfg, out_dir, **kwargs)
        self.records = list(records)
        self.tokenizer = tokenizer
        self.first_pairs = list(pairs)

    def sampling(self, step: int) -> SamplingConfig:
        """How the pairs of `step` are sampled (seeded by the run seed and the step)."""
        cfg = self.cfg
        return SamplingConfig(
            samples=cfg.resample_samples, max_new_tokens=cfg.resample_max_new_tokens,
            temperature=cfg.resample_temperature, top_k=None, seed=cfg.seed * 1_000_003 + step,
            greedy=cfg.resample_greedy,
        )  # fmt: skip

    def pairs_file(self, step: int) -> Path:
        """Where the pairs re-made at `step` are kept."""
        return self.run_dir.out_dir / PAIRS_DIR / f"step_{step}.jsonl"

    def resample(self, step: int) -> list[TokenPair]:
        """Pairs from the current policy's replies to this round's prompts (written to disk)."""
        k = step // self.cfg.resample_every
        n = min(self.cfg.resample_prompts, len(self.records))
        picked = [self.records[i] for i in epoch_slice(len(self.records), n, k, self.cfg.seed + 1)]
        block = self.policy.cfg.block_size
        made = []
        for _record, _replies, pair in build_pairs(
            self.policy, self.tokenizer, picked, self.sampling(step)
        ):
            if pair is None:
                continue
            tp = tokenize_pair(pair, self.tokenizer, f"online pair of step {step}")
            if len(tp.prompt) + max(len(tp.chosen), len(tp.rejected)) <= block:
                made.append(tp)
        path = self.pairs_file(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as handle:
            for tp in made:
                handle.write(json.dumps([tp.prompt, tp.chosen, tp.rejected]) + "\n")
        return made

    def read_pairs_of(self, step: int) -> list[TokenPair] | None:
        """The pairs re-made at `step` by an earlier process, or None."""
        path = self.pairs_file(step)
        if not path.is_file():
            return None
        return [TokenPair(*json.loads(line)) for line in path.read_text().splitlines() if line]

    def before_step(self) -> None:
        """At each re-sampling step, the new pairs (kept when none could be made)."""
        every = self.cfg.resample_every
        start = (self.step // every) * every
        if self.step % every and getattr(self, "_round", None) == start:
            return
        made = self.read_pairs_of(start) if self.step % every else None
        if made is None:  # a round's first step (or its file is gone): sample now
            made = self.resample(start)
        self._round = start
        self.policy.train()
        self.pairs = made or self.pairs or self.first_pairs
        self.notes = {"online_pairs": len(made)}
