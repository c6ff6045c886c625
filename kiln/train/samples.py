"""Sampled continuations at eval steps: a few prompts decoded off the training RNG streams.

Sampling is seeded (temperature 0.8, top-k 50, the same seed at every eval step, so samples at
different steps differ only by the weights) and draws from its own `torch.Generator`; the global
torch RNG state is forked around it as well, so a run with samples takes exactly the training
steps of a run without (and resumes exactly). The tokenizer is the one the dataset's manifest
names, checked by sha256 (a different file is refused); when it is missing, sampling is skipped
with one warning. The prompts are user text: special-token text in them is refused unless
`eval.allow_special` is set, and they are encoded when the sampler is built, before training.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.data import Dataset
from kiln.errors import KilnError
from kiln.model import Transformer
from kiln.model.generate import generate
from kiln.tokenizer import Tokenizer
from kiln.tokenizer.user_text import encode_user_text
from kiln.train.distributed import DistInfo
from kiln.train.parallelize import parallel_mode

if TYPE_CHECKING:
    from kiln.train.config import TrainConfig
    from kiln.train.sources import TrainData

TEMPERATURE = 0.8
TOP_K = 50


class ContinuationSampler:
    """Decodes `max_new_tokens` after each prompt with a fixed seed; returns JSON-ready records."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompts: Sequence[str],
        max_new_tokens: int,
        seed: int,
        eot_id: int | None = None,
        allow_special: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.stop = [eot_id] if eot_id is not None else []
        start = self.stop or [0]  # an empty prompt starts after end-of-text (a fresh document)
        self.encoded = [
            encode_user_text(tokenizer, p, allow_special, f"eval.sample_prompts[{i}] {p!r}",
                             "set eval.allow_special = true")
            or list(start)
            for i, p in enumerate(self.prompts)
        ]  # fmt: skip

    @classmethod
    def for_dataset(
        cls,
        dataset: Dataset,
        prompts: Sequence[str],
        max_new_tokens: int,
        seed: int,
        allow_special: bool = False,
    ) -> ContinuationSampler | None:
        """A sampler with the dataset's tokenizer, or None (with one warning) when it is missing.

        A tokenizer file whose sha256 is not the manifest's is refused with one line: samples
        decoded with another vocabulary would be silently wrong.
        """
        if max_new_tokens <= 0 or not prompts:
            return None
        entry = dataset.manifest.tokenizer
        path = entry.locate(
            Path(dataset.root),
            hint="; restore the original file, or set eval.sample_tokens = 0 to train without "
            "samples",
        )
        if path is None:
            warnings.warn(
                f"eval samples skipped: the dataset's tokenizer {entry.path} was not found "
                f"(nor next to the dataset in {dataset.root}); set eval.sample_tokens = 0 to "
                "silence this",
                stacklevel=2,
            )
            return None
        try:
            from kiln.tokenizer.formats import read_any  # kiln, HF or GPT-2 vocab.json

            tokenizer = read_any(path)
        except (KilnError, OSError, ValueError) as exc:
            warnings.warn(f"eval samples skipped: cannot load {path}: {exc}", stacklevel=2)
            return None
        return cls(tokenizer, prompts, max_new_tokens, seed, entry.eot_id, allow_special)

    def sample(self, model: Transformer, step: int) -> list[dict[str, Any]]:
        """One {"step", "prompt", "text"} per prompt (text: the continuation only)."""
        device = next(model.parameters()).device
        forked = [device.index or 0] if device.type == "cuda" else []
        was_training = model.training
        records = []
        with torch.random.fork_rng(devices=forked):
            model.eval()
            try:
                for prompt, ids in zip(self.prompts, self.encoded, strict=True):
                    room = min(self.max_new_tokens, model.cfg.block_size - len(ids))
                    new: list[int] = []
                    if room >= 1:
                        (new,) = generate(
                            model, [ids], room, temperature=TEMPERATURE, top_k=TOP_K,
                            seed=self.seed, stop_tokens=self.stop,
                        )  # fmt: skip
                    known = [t for t in new if t < self.tokenizer.n_vocab]  # a padded vocab
                    text = self.tokenizer.decode(known)
                    records.append({"step": step, "prompt": prompt, "text": text})
            finally:
                model.train(was_training)
        return records


def eval_sampler(cfg: TrainConfig, dist: DistInfo, data: TrainData) -> ContinuationSampler | None:
    """The eval-step sampler on rank 0, or None (sampling off, sharded weights, no tokenizer).

    Rank 0 decodes alone with the unwrapped model, which needs every weight on rank 0: with FSDP
    or a multi-process mesh each rank holds a part, so samples are skipped there, with one
    warning.
    """
    ev = cfg.eval
    if not dist.is_main or ev.sample_tokens <= 0 or not ev.sample_prompts:
        return None
    mode = parallel_mode(cfg, dist)
    if mode == "fsdp" or (mode == "mesh" and dist.world_size > 1):
        warnings.warn(
            f"eval samples skipped: not supported with train.parallel = {mode!r} (sample from "
            "a checkpoint instead, or set eval.sample_tokens = 0 to silence this)",
            stacklevel=3,
        )
        return None
    return data.sampler(ev, cfg.train.seed)


def format_sample(record: dict[str, Any]) -> str:
    """One console line for a sample: the prompt, then the continuation on the same line."""
    text = f"{record['prompt']}{record['text']}".replace("\n", " ⏎ ")
    return f"  sample @ step {record['step']}: {text}"
