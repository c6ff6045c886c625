"""The independent checker: a small CNN that reads a picture's objects, colours and layout.

It is trained only on rendered pictures and their ground truth (never on generated ones), and
it scores generated pictures against the captions they were drawn for. For each of the 29
kinds it predicts: is one present (sigmoid), its colour (softmax over the 11 colours), and the
centre of its box (x, y as fractions of the side). A relation ("A under B") is right when the
predicted centres obey it, the same test the renderer's layout obeys. Its penultimate features
(256 numbers per picture) are what the Fréchet distance is computed on.

The default head (`model.head = "spatial"`) is fully convolutional: an 8×8 map of per-cell
logits for each kind, pooled by logsumexp into presence; the kind's softmax over cells weighs
the cell centres (its box centre) and the cells' colour logits (its colour). A kind is then
learnt once, wherever it stands. The old head (`"flat"`: flatten the 4×4 map into one linear
layer) has to learn every kind at every place and reads ~40% of objects after the demo's budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.config import require
from kiln.image.scenes import COLOURS, KINDS

KIND_NAMES = list(KINDS)
COLOUR_NAMES = list(COLOURS)
K, NC = len(KIND_NAMES), len(COLOUR_NAMES)


@dataclass
class CheckerConfig:
    """The CNN's width and feature size, and the loss weight of the box centres."""

    image_size: int = 32
    channels: int = 32  # of the first conv; doubled at each of the first two downsamples
    features: int = 256  # the penultimate layer: what the Fréchet distance compares
    centre_weight: float = 10.0
    head: str = "spatial"  # "spatial" (per-cell maps, pooled) or "flat" (the first checkers')

    def __post_init__(self) -> None:
        require(
            self.head in ("spatial", "flat"),
            f"model.head must be spatial or flat, got {self.head!r}",
        )
        side = self.image_size
        require(
            side >= 8 and side & (side - 1) == 0,
            f"model.image_size must be a power of two >= 8, got {side}",
        )
        require(self.channels >= 1 and self.features >= 1, "model.channels/features must be >= 1")


class Checker(nn.Module):
    """Pictures (B, 3, S, S) in [-1, 1] -> presence (B, K), colour (B, K, NC), centre (B, K, 2)."""

    def __init__(self, cfg: CheckerConfig) -> None:
        super().__init__()
        self.config = cfg
        if cfg.head == "spatial":
            self._build_spatial(cfg)
            return
        layers: list[nn.Module] = [nn.Conv2d(3, cfg.channels, 3, padding=1)]
        width = cfg.channels
        for i in range(int(math.log2(cfg.image_size // 4))):  # down to 4×4
            out = width * 2 if i < 2 else width
            layers += [nn.GroupNorm(8 if width % 8 == 0 else 1, width), nn.SiLU(),
                       nn.Conv2d(width, out, 3, stride=2, padding=1)]  # fmt: skip
            width = out
        layers += [nn.SiLU(), nn.Flatten(), nn.Linear(width * 16, cfg.features), nn.SiLU()]
        self.body = nn.Sequential(*layers)
        self.present = nn.Linear(cfg.features, K)
        self.colour = nn.Linear(cfg.features, K * NC)
        self.centre = nn.Linear(cfg.features, K * 2)

    def _build_spatial(self, cfg: CheckerConfig) -> None:
        layers: list[nn.Module] = [nn.Conv2d(3, cfg.channels, 3, padding=1)]
        width = cfg.channels
        for i in range(max(0, int(math.log2(cfg.image_size // 8)))):  # down to 8×8
            out = width * 2 if i < 2 else width
            layers += [nn.GroupNorm(_groups(width), width), nn.SiLU(),
                       nn.Conv2d(width, out, 3, stride=2, padding=1)]  # fmt: skip
            width = out
        # One more 3×3 at 8×8 so a cell sees a whole object (receptive field 17 px at 32×32).
        layers += [nn.GroupNorm(_groups(width), width), nn.SiLU(),
                   nn.Conv2d(width, width, 3, padding=1), nn.GroupNorm(_groups(width), width),
                   nn.SiLU(), nn.Conv2d(width, cfg.features, 1), nn.SiLU()]  # fmt: skip
        self.body = nn.Sequential(*layers)
        self.present = nn.Conv2d(cfg.features, K, 1)
        # Start at the base rate (~2 of 29 kinds in a picture), not at "every kind is there":
        # otherwise the first hundreds of steps only push 29 presences down.
        nn.init.constant_(self.present.bias, math.log(2 / (K - 2)))
        self.colour = nn.Conv2d(cfg.features, K * NC, 1)

    def features(self, x: Tensor) -> Tensor:
        """The penultimate features (B, features)."""
        f = self.body(x)
        return f.mean((2, 3)) if self.config.head == "spatial" else f

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        """The three heads' outputs (logits, logits, centres) and the features."""
        if self.config.head == "spatial":
            return self._forward_spatial(x)
        f = self.body(x)
        B = x.shape[0]
        return {
            "present": self.present(f), "colour": self.colour(f).view(B, K, NC),
            "centre": torch.sigmoid(self.centre(f)).view(B, K, 2), "features": f,
        }  # fmt: skip

    def _forward_spatial(self, x: Tensor) -> dict[str, Tensor]:
        h = self.body(x)
        B, _, H, W = h.shape
        logits = self.present(h).flatten(2)  # (B, K, cells)
        where = logits.softmax(-1)  # each kind's attention over the cells
        ys, xs = torch.meshgrid(
            (torch.arange(H, device=h.device) + 0.5) / H,
            (torch.arange(W, device=h.device) + 0.5) / W,
            indexing="ij",
        )
        cells = torch.stack([xs.flatten(), ys.flatten()], -1).to(h.dtype)  # (cells, 2)
        colour = (self.colour(h).view(B, K, NC, H * W) * where.unsqueeze(2)).sum(-1)
        return {
            # log-mean-exp: a soft max over cells that, unlike logsumexp, does not grow with them
            "present": torch.logsumexp(logits, -1) - math.log(H * W), "colour": colour,
            "centre": where @ cells, "features": h.mean((2, 3)),
        }  # fmt: skip


def _groups(width: int) -> int:
    return 8 if width % 8 == 0 else 1


def targets(records: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Ground truth per kind from records: present (N, K), colour (N, K; -1 none), centre."""
    n = len(records)
    present = torch.zeros(n, K)
    colour = torch.full((n, K), -1, dtype=torch.long)
    centre = torch.zeros(n, K, 2)
    centre_mask = torch.zeros(n, K)
    for i, record in enumerate(records):
        by_kind: dict[int, list[dict[str, Any]]] = {}
        for obj in record["objects"]:
            by_kind.setdefault(KIND_NAMES.index(obj["kind"]), []).append(obj)
        for k, objs in by_kind.items():
            present[i, k] = 1
            colours = {o["colour"] for o in objs}
            if len(colours) == 1 and None not in colours:  # one colour for the kind: learnable
                colour[i, k] = COLOUR_NAMES.index(colours.pop())
            boxes = torch.tensor([o["box"] for o in objs])
            centre[i, k, 0] = ((boxes[:, 0] + boxes[:, 2]) / 2).mean()
            centre[i, k, 1] = ((boxes[:, 1] + boxes[:, 3]) / 2).mean()
            centre_mask[i, k] = 1
    return {"present": present, "colour": colour, "centre": centre, "centre_mask": centre_mask}


def checker_loss(out: dict[str, Tensor], truth: dict[str, Tensor], cfg: CheckerConfig) -> Tensor:
    """BCE on presence + CE on the colours of present kinds + weighted MSE on their centres."""
    # Summed over kinds (not averaged): a mean over 29 mostly-absent kinds teaches base rates.
    presence = F.binary_cross_entropy_with_logits(out["present"], truth["present"], reduction="sum")
    loss = presence / out["present"].shape[0]
    known = truth["colour"] >= 0
    if known.any():
        loss = loss + F.cross_entropy(out["colour"][known], truth["colour"][known])
    mask = truth["centre_mask"].unsqueeze(-1)
    err = ((out["centre"] - truth["centre"]) ** 2 * mask).sum() / mask.sum().clamp_min(1)
    return loss + cfg.centre_weight * err


def relation_holds(relation: str, subject: Tensor, obj: Tensor) -> bool:
    """Whether centres (x, y) of subject and object (y grows downward) obey `relation`."""
    if relation == "left of":
        return bool(subject[0] < obj[0])
    if relation == "right of":
        return bool(subject[0] > obj[0])
    if relation == "above":
        return bool(subject[1] < obj[1])
    return bool(subject[1] > obj[1])  # under


@torch.no_grad()
def predict(checker: Checker, images: Tensor, batch: int = 256) -> dict[str, Tensor]:
    """The checker's outputs for pictures (N, 3, S, S) in [-1, 1], batched, on the CPU."""
    checker.eval()
    device = next(checker.parameters()).device
    parts = [checker(images[i : i + batch].to(device)) for i in range(0, len(images), batch)]
    return {k: torch.cat([p[k] for p in parts]).cpu() for k in parts[0]}


def score(out: dict[str, Tensor], records: list[dict[str, Any]]) -> dict[str, float]:
    """Per-attribute accuracy of predictions against the scenes pictures were meant to show.

    object: each caption group's kind is among the checker's k likeliest kinds, k the number of
    kinds the caption names (no threshold to tune on an imbalanced head); colour: the kind's predicted colour
    is the caption's (groups with a colour); relation: the predicted centres obey it (scenes of
    two different kinds); all: a picture with every one of those right.
    """
    hits = {"object": [0, 0], "colour": [0, 0], "relation": [0, 0]}
    whole = 0
    order = out["present"].argsort(dim=-1, descending=True)
    colour = out["colour"].argmax(-1)
    for i, record in enumerate(records):
        ok = True
        named = {g["kind"] for g in record["groups"]}
        likeliest = {KIND_NAMES[j] for j in order[i, : len(named)].tolist()}
        for group in record["groups"]:
            k = KIND_NAMES.index(group["kind"])
            right = group["kind"] in likeliest
            hits["object"][0] += right
            hits["object"][1] += 1
            ok &= right
            if group["colour"] is not None:
                right = int(colour[i, k]) == COLOUR_NAMES.index(group["colour"])
                hits["colour"][0] += right
                hits["colour"][1] += 1
                ok &= right
        relation = record.get("relation")
        kinds = [g["kind"] for g in record["groups"]]
        if relation is not None and kinds[0] != kinds[1]:
            s, o = (KIND_NAMES.index(k) for k in kinds)
            right = relation_holds(relation, out["centre"][i, s], out["centre"][i, o])
            hits["relation"][0] += right
            hits["relation"][1] += 1
            ok &= right
        whole += ok
    result = {name: (h / n if n else math.nan) for name, (h, n) in hits.items()}
    result["all"] = whole / max(len(records), 1)
    return result


def frechet_distance(a: Tensor, b: Tensor) -> float:
    """Fréchet distance between Gaussians fitted to feature sets a (N, D) and b (M, D).

    ‖μa - μb‖² + tr(Σa + Σb - 2(Σa^½ Σb Σa^½)^½), the matrix roots by symmetric eigensolves
    (exact for covariance matrices, with no complex parts to discard).
    """
    x, y = a.double().numpy(), b.double().numpy()
    mu_x, mu_y = x.mean(0), y.mean(0)
    cov_x, cov_y = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    w, v = np.linalg.eigh(cov_x)
    root_x = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    middle = np.linalg.eigvalsh(root_x @ cov_y @ root_x)
    cross = np.sqrt(np.clip(middle, 0, None)).sum()
    return float(((mu_x - mu_y) ** 2).sum() + np.trace(cov_x) + np.trace(cov_y) - 2 * cross)
