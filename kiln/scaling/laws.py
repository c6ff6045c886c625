"""Parametric scaling laws L(N, D) = E + A/N^α + B/D^β and their compute-optimal allocation.

With training compute C = 6·N·D, minimising L over N at fixed C has a closed form (Hoffmann et
al. 2022, eq. 4): N_opt = G·(C/6)^a and D_opt = G⁻¹·(C/6)^b with a = β/(α+β), b = α/(α+β),
G = (α·A / (β·B))^(1/(α+β)).

Published fits (losses in nats per token on each paper's own data and tokenizer, so their
absolute values do not transfer to another corpus; the exponents and the N:D split are the
useful part):
- "chinchilla": Hoffmann et al. (2022), "Training Compute-Optimal Large Language Models",
  approach 3, eq. (10): E = 1.69, A = 406.4, B = 410.7, α = 0.34, β = 0.28.
- "epoch": Besiroglu, Erdil, Barnett & You (2024), "Chinchilla Scaling: A replication attempt"
  (Epoch AI), their re-fit of the same data: E = 1.8172, A = 482.01, B = 2085.43,
  α = 0.3478, β = 0.3658: about 20 tokens per parameter at the optimum, as the paper's own
  approaches 1 and 2 found, where approach 3 as published gives 50 to 90.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kiln.errors import KilnError


@dataclass(frozen=True)
class ScalingLaw:
    """L(N, D) = E + A/N^α + B/D^β, N parameters, D training tokens."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    name: str = "custom"
    source: str = ""

    def __post_init__(self) -> None:
        """The closed-form optimum needs positive coefficients and exponents."""
        if min(self.A, self.B, self.alpha, self.beta) <= 0:
            raise KilnError(f"scaling law {self.name}: A, B, alpha and beta must all be > 0")

    def loss(self, n: float, d: float) -> float:
        """Predicted loss of a model of n parameters trained on d tokens."""
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    @property
    def a(self) -> float:
        """Exponent of N_opt ∝ C^a."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of D_opt ∝ C^b (a + b = 1)."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        """The constant of the compute-optimal allocation."""
        return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

    def optimal(self, flops: float) -> tuple[float, float]:
        """Compute-optimal (N, D) for C = 6·N·D FLOPs."""
        _positive("flops", flops)
        return self.G * (flops / 6) ** self.a, (flops / 6) ** self.b / self.G

    def flops_for_params(self, n: float) -> float:
        """The budget at which n parameters are compute-optimal."""
        _positive("params", n)
        return 6 * (n / self.G) ** (1 / self.a)

    def flops_for_tokens(self, d: float) -> float:
        """The budget at which d tokens are compute-optimal."""
        _positive("tokens", d)
        return 6 * (d * self.G) ** (1 / self.b)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for JSON."""
        return asdict(self)


@dataclass(frozen=True)
class TokensPerParam:
    """The "20 tokens per parameter" rule: D = r·N, so C = 6·r·N² at the optimum."""

    ratio: float = 20.0
    name: str = "20x"

    def optimal(self, flops: float) -> tuple[float, float]:
        """(N, D) with D = ratio·N and 6·N·D = flops."""
        _positive("flops", flops)
        n = math.sqrt(flops / (6 * self.ratio))
        return n, self.ratio * n

    def flops_for_params(self, n: float) -> float:
        """6·N·(ratio·N)."""
        _positive("params", n)
        return 6 * self.ratio * n * n

    def flops_for_tokens(self, d: float) -> float:
        """6·(D/ratio)·D."""
        _positive("tokens", d)
        return 6 * d * d / self.ratio


CHINCHILLA = ScalingLaw(
    E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28, name="chinchilla",
    source="Hoffmann et al. 2022, approach 3, eq. (10)",
)  # fmt: skip
EPOCH = ScalingLaw(
    E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658, name="epoch",
    source="Besiroglu et al. 2024 (Epoch AI), Chinchilla replication",
)  # fmt: skip
LAWS: dict[str, ScalingLaw | TokensPerParam] = {
    "chinchilla": CHINCHILLA,
    "epoch": EPOCH,
    "20x": TokensPerParam(),
}


def get_law(name: str) -> ScalingLaw | TokensPerParam:
    """A law by name (chinchilla, epoch or 20x), or the fitted law of a `kiln scaling fit` fit.json."""
    if name.endswith(".json") or Path(name).is_file():
        return load_fitted_law(name)
    try:
        return LAWS[name]
    except KeyError:
        raise KilnError(
            f"unknown scaling law {name!r}; known: {', '.join(LAWS)}, or a fit.json path"
        ) from None


def load_fitted_law(path: str | Path) -> ScalingLaw:
    """The parametric L(N, D) (approach 3) that `kiln scaling fit` wrote to fit.json."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KilnError(f"{path}: cannot read the fit ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise KilnError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    fit = doc.get("parametric") if isinstance(doc, dict) else None
    if not isinstance(fit, dict):
        raise KilnError(f"{path}: no parametric fit (a `kiln scaling fit` fit.json has one)")
    try:
        consts = {k: float(fit[k]) for k in ("E", "A", "B", "alpha", "beta")}
    except (KeyError, TypeError, ValueError):
        raise KilnError(f"{path}: parametric fit needs numbers E, A, B, alpha, beta") from None
    return ScalingLaw(**consts, name=str(path), source=f"kiln scaling fit ({path})")


# Muennighoff et al. (2023), "Scaling Data-Constrained Language Models", eq. (5) fitted: repeated
# tokens are worth less each epoch, and past ~R* repetitions little more is learnt; parameters
# beyond what the unique data is compute-optimal for decay likewise, faster (R*_N).
REPEAT_R_STAR = 15.4
EXCESS_PARAMS_R_STAR = 5.3


def effective_tokens(tokens: float, unique: float, r_star: float = REPEAT_R_STAR) -> float:
    """Fresh-data equivalent of training `tokens` on `unique` distinct tokens, repeated.

    D' = U + U·R*·(1 − exp(−R/R*)) with R = tokens/U − 1 repetitions (Muennighoff et al. 2023);
    D' = tokens while the data lasts one epoch.
    """
    _positive("tokens", tokens)
    _positive("unique tokens", unique)
    if tokens <= unique:
        return tokens
    repeats = tokens / unique - 1
    return unique + unique * r_star * (1 - math.exp(-repeats / r_star))


def effective_params(
    params: float, unique_params: float, r_star: float = EXCESS_PARAMS_R_STAR
) -> float:
    """N' = U_N + U_N·R*_N·(1 − exp(−R_N/R*_N)), R_N = N/U_N − 1 (Muennighoff et al. 2023).

    U_N is the size compute-optimal for one epoch of the unique data; beyond it, extra
    parameters are worth less; N' = N up to U_N.
    """
    _positive("params", params)
    _positive("unique params", unique_params)
    if params <= unique_params:
        return params
    excess = params / unique_params - 1
    return unique_params + unique_params * r_star * (1 - math.exp(-excess / r_star))


def _positive(what: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise KilnError(f"{what} must be a positive number, got {value}")
