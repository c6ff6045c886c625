"""The neural rungs below the Transformer: a learned bigram and Bengio's n-gram MLP.

Both have the Transformer's scoring interface (`hidden`, `logits`, a `cfg` with `vocab_size` and
`block_size`, and `forward(idx, targets)` returning the mean loss), so kiln.eval's Scorer and
bits-per-byte score them exactly as they score a Transformer.

- learned bigram (the course's chapter 1): a V×V table of logits, one row per previous token.
- n-gram MLP (Bengio et al. 2003, chapter 3): the embeddings of the previous `context` tokens,
  concatenated, through one tanh hidden layer to the logits. Before the start of a sequence
  a learned padding embedding stands in for the missing tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.errors import KilnError

KINDS = ("bigram", "mlp")


@dataclass(frozen=True)
class BaselineConfig:
    """A neural baseline's sizes; `block_size` only bounds the windows it is scored in."""

    kind: str
    vocab_size: int
    block_size: int = 256
    context: int = 4  # mlp: previous tokens seen (a 5-gram model)
    n_embd: int = 64  # mlp: embedding width per token
    hidden: int = 512  # mlp: tanh layer width

    def __post_init__(self) -> None:
        """Reject an unknown kind or a size below 1, naming the field."""
        if self.kind not in KINDS:
            raise KilnError(f"baseline kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("vocab_size", "block_size", "context", "n_embd", "hidden"):
            if getattr(self, name) < 1:
                raise KilnError(f"baseline {name} must be >= 1, got {getattr(self, name)}")


class LearnedBigram(nn.Module):
    """logits(next | previous) = W[previous]: embedding straight to logits."""

    def __init__(self, cfg: BaselineConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.table = nn.Embedding(cfg.vocab_size, cfg.vocab_size)
        nn.init.zeros_(self.table.weight)  # the uniform distribution before any step

    def hidden(self, idx: Tensor) -> Tensor:
        """(B, T) -> (B, T, V): the previous token's row."""
        return self.table(idx)

    def logits(self, h: Tensor) -> Tensor:
        """The rows are the logits."""
        return h

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of targets (B, T) given idx (B, T)."""
        return F.cross_entropy(self.hidden(idx).flatten(0, 1).float(), targets.flatten())


class NGramMLP(nn.Module):
    """Bengio's neural probabilistic LM: concat(embeddings of `context` tokens) -> tanh -> logits."""

    def __init__(self, cfg: BaselineConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size + 1, cfg.n_embd)  # row V: before the start
        self.proj = nn.Linear(cfg.context * cfg.n_embd, cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size)
        nn.init.normal_(self.embed.weight, std=0.1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def hidden(self, idx: Tensor) -> Tensor:
        """(B, T) -> (B, T, hidden): position t sees tokens t-context+1 .. t."""
        n = self.cfg.context
        padded = F.pad(idx, (n - 1, 0), value=self.cfg.vocab_size)  # (B, T+n-1)
        windows = padded.unfold(1, n, 1)  # (B, T, n), oldest first
        e = self.embed(windows).flatten(2)  # (B, T, n·E)
        return torch.tanh(self.proj(e))

    def logits(self, h: Tensor) -> Tensor:
        """(…, hidden) -> (…, V)."""
        return self.head(h)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of targets (B, T) given idx (B, T)."""
        logits = self.logits(self.hidden(idx))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_baseline(cfg: BaselineConfig) -> nn.Module:
    """The module of `cfg.kind`."""
    return LearnedBigram(cfg) if cfg.kind == "bigram" else NGramMLP(cfg)
