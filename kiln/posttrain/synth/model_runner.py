"""The model side of synthetic data and annotation: load a model, name it, and run prompts
through the engine (completions, or the expected score from the logits of the digits 0-5).

Every request carries its own seed, and the engine is batch-invariant by default, so a document
depends only on its prompt, seed and the model: a resumed run writes what an uninterrupted one
would have.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError
from kiln.posttrain.synth.config import ModelSection, SamplingSection

DIGITS = tuple(str(d) for d in range(6))


def weights_sha256(path: Path) -> tuple[str, str]:
    """(sha256 of the model's weight files, the checkpoint or folder they are in)."""
    from kiln.io import sha256_file
    from kiln.loading import find_checkpoint, folder_kind

    folder = path if folder_kind(path) == "hf" else find_checkpoint(path)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise KilnError(f"{folder}: no weight file (*.safetensors or *.bin) to take the sha256 of")
    if len(files) == 1:
        return sha256_file(files[0]), str(folder)
    joined = hashlib.sha256()
    for f in files:  # several shards: the hash of their names and hashes, in name order
        joined.update(f"{f.name}:{sha256_file(f)}\n".encode())
    return joined.hexdigest(), str(folder)


@dataclass
class SynthModel:
    """A loaded model, its engine, its identity and how prompts are encoded for it."""

    engine: Any
    tokenizer: Any
    block_size: int
    chat: bool
    provenance: dict[str, Any]  # model path, checkpoint, sha256 (shared by every document)

    def encode(self, prompt: str, budget: int) -> list[int]:
        """The prompt's ids (rendered as a user turn for a chat model), at most `budget`."""
        from kiln.tokenizer.user_text import encode_user_text

        if self.chat:
            from kiln.chat.render import render

            ids = render([{"role": "user", "content": prompt}], self.tokenizer, True).ids
        else:  # a base model starts a document after an end-of-text, as in its training data
            start = [] if self.engine.eot_id is None else [self.engine.eot_id]
            ids = start + encode_user_text(self.tokenizer, prompt, False, "the prompt", None)
        if len(ids) > budget:
            raise KilnError(
                f"a prompt of {len(ids)} tokens leaves no room in the model's context of "
                f"{self.block_size}; lower max_input_tokens or sampling.max_tokens"
            )
        return ids

    def cut(self, text: str, max_tokens: int) -> str:
        """`text` cut to its first `max_tokens` tokens (on a token boundary)."""
        ids = self.tokenizer.encode(text)
        return text if len(ids) <= max_tokens else self.tokenizer.decode(ids[:max_tokens])

    def complete(
        self, prompts: Sequence[str], seeds: Sequence[int], sampling: SamplingSection
    ) -> list[tuple[str, str]]:
        """(text, finish reason) of each prompt, sampled with its own seed, in one batch."""
        from kiln.serve.engine import SamplingParams

        ids, params = [], []
        for prompt, seed in zip(prompts, seeds, strict=True):
            p = self.encode(prompt, self.block_size - 1)
            ids.append(p)
            params.append(
                SamplingParams(
                    max_tokens=min(sampling.max_tokens, self.block_size - len(p)),
                    temperature=sampling.temperature,
                    top_k=sampling.top_k,
                    top_p=sampling.top_p,
                    repetition_penalty=sampling.repetition_penalty,
                    seed=seed,
                )
            )
        return [(c[0].text, c[0].finish_reason) for c in self.engine.generate(ids, params)]

    def digit_scores(self, prompts: Sequence[str]) -> list[dict[str, Any]]:
        """Per prompt: the expected score over the next token's digits 0-5, and their mass.

        FineWeb-Edu parsed the score from the annotator's reply; the expectation over the digit
        logits is deterministic and always defined, whatever the model writes.
        """
        from kiln.serve.engine import SamplingParams

        candidates = self._digit_tokens()
        rows: list[torch.Tensor | None] = [None] * len(prompts)
        ids, params = [], []
        for i, prompt in enumerate(prompts):
            ids.append(self.encode(prompt, self.block_size - 1))

            def capture(_done: Sequence[int], row: torch.Tensor, i: int = i) -> torch.Tensor:
                rows[i] = row.detach().float().clone()
                return row

            params.append(
                SamplingParams(max_tokens=1, temperature=0.0, logits_processors=(capture,))
            )
        self.engine.generate(ids, params)
        out = []
        for row in rows:
            assert row is not None  # every request ran one step
            logp = row.log_softmax(-1)
            per_digit = torch.stack([torch.logsumexp(logp[c], 0) for c in candidates])
            probs = per_digit.softmax(0)
            expected = float((probs * torch.arange(6, dtype=probs.dtype)).sum())
            out.append(
                {
                    "score": round(expected, 6),
                    "digit": int(probs.argmax()),
                    "probs": [round(float(p), 6) for p in probs],
                    "digit_mass": round(math.exp(float(torch.logsumexp(per_digit, 0))), 6),
                }
            )
        return out

    def _digit_tokens(self) -> list[torch.Tensor]:
        """Each digit's single-token spellings ("3", " 3") in this vocabulary."""
        found = []
        for d in DIGITS:
            spellings = {tuple(self.tokenizer.encode(s)) for s in (d, f" {d}")}
            ids = sorted({t[0] for t in spellings if len(t) == 1})
            if not ids:
                raise KilnError(f"the model's tokenizer has no single token for the digit {d!r}")
            found.append(torch.tensor(ids))
        return found


def load_synth_model(section: ModelSection, where: str) -> SynthModel:
    """Load `section.path` with its engine; a bad path or tokenizer is one line naming both."""
    from kiln.chat.template import chat_template_of
    from kiln.loading import load_model
    from kiln.serve.engine import Engine, EngineConfig

    path = Path(section.path)
    if not path.exists():
        raise KilnError(f"{where}: model.path = {section.path!r}: no such model folder")
    if section.tokenizer and not Path(section.tokenizer).exists():
        raise KilnError(f"{where}: model.tokenizer = {section.tokenizer!r}: no such file")
    try:
        loaded = load_model(path, section.tokenizer or None, section.device, section.dtype)
        sha, folder = weights_sha256(path)
    except KilnError as exc:
        field = "model.tokenizer" if section.tokenizer else "model.path"
        raise KilnError(f"{where}: {field}: {exc}") from None
    assert loaded.tokenizer is not None  # need_tokenizer=True raises without one
    chat = section.prompt_format == "chat" or (
        section.prompt_format == "auto" and chat_template_of(loaded.tokenizer) is not None
    )
    if chat and chat_template_of(loaded.tokenizer) is None:
        raise KilnError(f"{where}: model.prompt_format = 'chat': the tokenizer has no chat tokens")
    engine = Engine.from_loaded(
        loaded,
        EngineConfig(
            max_num_seqs=section.batch_size,
            max_waiting=max(4096, section.batch_size),
            batch_invariant=section.batch_invariant,
        ),
    )
    provenance = {
        "model": str(path),
        "model_sha256": sha,
        "checkpoint": folder,
        "tokenizer": str(loaded.tokenizer_path) if loaded.tokenizer_path else "",
        "prompt_format": "chat" if chat else "plain",
    }
    block = int(loaded.model.cfg.block_size)
    return SynthModel(engine, loaded.tokenizer, block, chat, provenance)
