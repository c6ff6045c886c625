"""Scaling-law fits to (N, D, C, loss) points: IsoFLOP parabolas, power laws, parametric L(N, D).

- Approach 2 of Hoffmann et al. (2022): at each FLOP budget fit a parabola to loss against
  log N; its vertex is that budget's N_opt. Then fit N_opt ∝ C^a and D_opt ∝ C^b by least
  squares in log space, with D_opt = C / (6·N_opt).
- Approach 3 (their App. D): fit L(N, D) = E + A/N^α + B/D^β by minimising the Huber loss
  (δ = 1e-3) between log L̂ = LSE(a − α·log N, b − β·log D, e) and log L, with A = e^a,
  B = e^b, E = e^e, by L-BFGS from a grid of starting points.
"""

from __future__ import annotations

import csv
import itertools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.scaling.laws import ScalingLaw

HUBER_DELTA = 1e-3
# Hoffmann et al.'s initialisation grid (App. D.2).
GRID_ALPHA = (0.0, 0.5, 1.0, 1.5, 2.0)
GRID_BETA = GRID_ALPHA
GRID_E = (-1.0, -0.5, 0.0, 0.5, 1.0)
GRID_A = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
GRID_B = GRID_A
# Box for L-BFGS-B: wide enough for any language-model fit (E from 0.007 to 150 nats, exponents
# up to 5), tight enough that a run the data cannot pin down stops at a wall instead of
# wandering for thousands of iterations.
# Well-posed fits converge in under 100 iterations; ill-posed ones (too few runs) would use
# thousands to crawl along a flat valley, so they stop here and the notes say why.
MAX_ITER = 300
BOUNDS = ((-20.0, 60.0), (-20.0, 60.0), (-5.0, 5.0), (0.0, 5.0), (0.0, 5.0))


@dataclass(frozen=True)
class Point:
    """One finished run: N parameters, D tokens, C FLOPs (its budget) and its final loss."""

    n: float
    d: float
    c: float
    loss: float


@dataclass(frozen=True)
class Parabola:
    """loss = k2·x² + k1·x + k0 with x = log10 N, fitted to one budget's runs."""

    budget: float
    k2: float
    k1: float
    k0: float
    n_points: int

    @property
    def has_minimum(self) -> bool:
        """Whether the parabola opens upward (a vertex that is a minimum)."""
        return self.k2 > 0

    @property
    def n_opt(self) -> float:
        """N at the vertex."""
        return 10 ** (-self.k1 / (2 * self.k2))

    @property
    def loss_opt(self) -> float:
        """Loss at the vertex."""
        x = -self.k1 / (2 * self.k2)
        return self.k2 * x * x + self.k1 * x + self.k0


@dataclass(frozen=True)
class PowerLaw:
    """y = k · C^exponent, fitted in log space."""

    exponent: float
    k: float

    def __call__(self, c: float) -> float:
        """The fitted value at budget c."""
        return self.k * c**self.exponent


@dataclass
class ParametricFit:
    """The fitted law and how well it fits."""

    law: ScalingLaw
    objective: float  # Huber loss at the optimum (summed over points)
    rmse_log: float  # root-mean-square error of log L
    starts: int  # L-BFGS runs made
    converged: int  # of them, how many reported success
    best_converged: bool  # whether the run that won did
    at_bounds: list[str] = field(default_factory=list)  # parameters stopped at the search box


@dataclass
class FitReport:
    """Everything `kiln scaling fit` computes."""

    parabolas: list[Parabola] = field(default_factory=list)
    n_opt: PowerLaw | None = None
    d_opt: PowerLaw | None = None
    parametric: ParametricFit | None = None
    notes: list[str] = field(default_factory=list)
    power_law_budgets: list[float] = field(default_factory=list)  # whose minima the laws use

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (vertices included)."""
        out: dict[str, Any] = {
            "isoflop": [
                {
                    **asdict(p),
                    "n_opt": p.n_opt if p.has_minimum else None,
                    "loss_opt": p.loss_opt if p.has_minimum else None,
                }
                for p in self.parabolas
            ],
            "n_opt_power_law": asdict(self.n_opt) if self.n_opt else None,
            "d_opt_power_law": asdict(self.d_opt) if self.d_opt else None,
            "power_law_budgets": self.power_law_budgets,
            "parametric": None,
            "notes": self.notes,
        }
        if self.parametric is not None:
            p = self.parametric
            out["parametric"] = {
                **p.law.to_dict(), "a": p.law.a, "b": p.law.b, "objective": p.objective,
                "rmse_log": p.rmse_log, "starts": p.starts, "converged": p.converged,
                "best_converged": p.best_converged, "at_bounds": p.at_bounds,
            }  # fmt: skip
        return out


# ---- input -------------------------------------------------------------------------------------

_COLUMNS = {"n": ("params", "N"), "d": ("tokens", "D"), "c": ("budget", "flops", "C"),
            "loss": ("loss", "L")}  # fmt: skip


def read_points(path: str | Path) -> list[Point]:
    """Points from a CSV with columns params, tokens, budget (or flops), loss; or a sweep dir.

    Without a budget column each point's budget is 6·N·D (then no two runs share a budget
    unless they match exactly, and the IsoFLOP parabolas need shared budgets).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "results.csv"
    try:
        with path.open(encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle))
    except OSError as exc:
        raise KilnError(f"{path}: cannot read results ({exc.strerror})") from None
    if not rows:
        raise KilnError(f"{path}: no rows")
    header = set(rows[0])
    cols = {key: next((c for c in names if c in header), None) for key, names in _COLUMNS.items()}
    for key in ("n", "d", "loss"):
        if cols[key] is None:
            raise KilnError(f"{path}: needs a column named {' or '.join(_COLUMNS[key])}")
    points = []
    for line, row in enumerate(rows, start=2):
        try:
            n, d, loss = (float(row[cols[k]]) for k in ("n", "d", "loss"))  # type: ignore[index]
            c = float(row[cols["c"]]) if cols["c"] else 6 * n * d
        except (TypeError, ValueError):
            raise KilnError(f"{path}:{line}: expected numbers, got {row}") from None
        if min(n, d, loss, c) <= 0 or not all(map(math.isfinite, (n, d, loss, c))):
            raise KilnError(f"{path}:{line}: params, tokens, budget and loss must be positive")
        points.append(Point(n, d, c, loss))
    return points


# ---- approach 2 --------------------------------------------------------------------------------


def by_budget(points: list[Point]) -> dict[float, list[Point]]:
    """Points grouped by budget, budgets ascending."""
    groups: dict[float, list[Point]] = {}
    for p in points:
        groups.setdefault(p.c, []).append(p)
    return dict(sorted(groups.items()))


def fit_parabola(budget: float, points: list[Point]) -> Parabola:
    """Least-squares parabola of loss against log10 N (needs 3 distinct sizes)."""
    if len({p.n for p in points}) < 3:
        raise KilnError(f"budget {budget:.3g}: a parabola needs runs of 3 or more model sizes")
    x = np.log10([p.n for p in points])
    y = np.array([p.loss for p in points])
    k2, k1, k0 = np.polyfit(x, y, 2)
    return Parabola(budget, float(k2), float(k1), float(k0), len(points))


def fit_power_law(c: np.ndarray, y: np.ndarray) -> PowerLaw:
    """y = k·C^e by least squares on log y against log C (needs 2 budgets)."""
    if len(c) < 2:
        raise KilnError("a power law in C needs optima at 2 or more budgets")
    e, log_k = np.polyfit(np.log(c), np.log(y), 1)
    return PowerLaw(float(e), float(math.exp(log_k)))


def fit_isoflop(points: list[Point], extrapolated: str = "drop") -> FitReport:
    """Approach 2: a parabola per budget with 3+ sizes, then the power laws through the vertices.

    A vertex outside the sizes a budget tried is an extrapolation of the parabola, which is
    least trustworthy exactly there: by default ("drop") it is left out of the power laws, with
    a note; "keep" uses it anyway.
    """
    if extrapolated not in ("drop", "keep"):
        raise KilnError(f"extrapolated must be 'drop' or 'keep', got {extrapolated!r}")
    report = FitReport()
    inside: list[Parabola] = []
    for budget, group in by_budget(points).items():
        if len({p.n for p in group}) < 3:
            report.notes.append(f"budget {budget:.3g}: fewer than 3 sizes, no parabola")
            continue
        parabola = fit_parabola(budget, group)
        report.parabolas.append(parabola)
        if not parabola.has_minimum:
            report.notes.append(f"budget {budget:.3g}: the parabola has no minimum (opens down)")
            continue
        sizes = [p.n for p in group]
        if min(sizes) <= parabola.n_opt <= max(sizes):
            inside.append(parabola)
        else:
            report.notes.append(
                f"budget {budget:.3g}: N_opt {parabola.n_opt:.3g} lies outside the sizes run "
                f"({min(sizes):.3g}..{max(sizes):.3g}), so it is left out of the power laws; "
                "widen the sweep"
            )
    good = inside if extrapolated == "drop" else [p for p in report.parabolas if p.has_minimum]
    if len(good) >= 2:
        report.power_law_budgets = [p.budget for p in good]
        c = np.array([p.budget for p in good])
        n = np.array([p.n_opt for p in good])
        report.n_opt = fit_power_law(c, n)
        report.d_opt = fit_power_law(c, c / (6 * n))
    else:
        report.notes.append(
            "fewer than 2 budgets with a minimum inside their sizes: no N_opt(C), D_opt(C) power law"
        )
    return report


# ---- approach 3 --------------------------------------------------------------------------------


def _objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, log_l: np.ndarray, delta: float):
    """Summed Huber loss of log L̂ − log L and its gradient; theta = (a, b, e, α, β)."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * x, b - beta * y, np.full_like(x, e)])  # (3, P)
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    lse = top + np.log(total)
    w = weights / total  # softmax: ∂LSE/∂ each term
    r = lse - log_l
    small = np.abs(r) <= delta
    loss = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum()
    dr = np.where(small, r, delta * np.sign(r))  # Huber'(r)
    grad = np.array([
        (dr * w[0]).sum(), (dr * w[1]).sum(), (dr * w[2]).sum(),
        -(dr * w[0] * x).sum(), -(dr * w[1] * y).sum(),
    ])  # fmt: skip
    return loss, grad


def fit_parametric(
    points: list[Point], delta: float = HUBER_DELTA, top_starts: int | None = 64
) -> ParametricFit:
    """Approach 3: L-BFGS-B on the Huber objective from Hoffmann et al.'s grid of starts.

    Every grid point is scored first (cheaply, all at once); L-BFGS then runs from the
    `top_starts` best of them (None: from all 4,500, as in the paper) and the best end wins.
    """
    from scipy.optimize import minimize

    if len(points) < 5:
        raise KilnError(f"the parametric fit has 5 parameters and needs 5+ runs, got {len(points)}")
    x = np.log([p.n for p in points])
    y = np.log([p.d for p in points])
    log_l = np.log([p.loss for p in points])
    grid = np.array(list(itertools.product(GRID_A, GRID_B, GRID_E, GRID_ALPHA, GRID_BETA)))
    if top_starts is not None and top_starts < len(grid):
        scores = np.array([_objective(t, x, y, log_l, delta)[0] for t in grid])
        grid = grid[np.argsort(scores, kind="stable")[:top_starts]]
    best, converged = None, 0
    for start in grid:
        res = minimize(
            _objective, start, args=(x, y, log_l, delta), jac=True, method="L-BFGS-B",
            bounds=BOUNDS, options={"maxiter": MAX_ITER, "ftol": 1e-15, "gtol": 1e-12},
        )  # fmt: skip
        converged += bool(res.success)
        if best is None or res.fun < best.fun:
            best = res
    assert best is not None
    a, b, e, alpha, beta = (float(v) for v in best.x)
    if alpha <= 0 or beta <= 0:
        raise KilnError(
            f"the parametric fit found non-positive exponents (alpha={alpha:.3g}, "
            f"beta={beta:.3g}): the runs do not constrain L(N, D); add sizes or budgets"
        )
    law = ScalingLaw(
        E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta, name="fit",
        source="kiln scaling fit (Huber on log L, L-BFGS-B)",
    )  # fmt: skip
    pred = np.log([law.loss(p.n, p.d) for p in points])
    rmse = float(np.sqrt(np.mean((pred - log_l) ** 2)))
    names = ("log A", "log B", "log E", "alpha", "beta")
    at_bounds = [
        n
        for n, v, (lo, hi) in zip(names, best.x, BOUNDS, strict=True)
        if min(v - lo, hi - v) < 1e-6
    ]
    return ParametricFit(
        law, float(best.fun), rmse, len(grid), converged, bool(best.success), at_bounds
    )


def fit_all(
    points: list[Point], top_starts: int | None = 64, extrapolated: str = "drop"
) -> FitReport:
    """Both approaches; the parametric fit is skipped (with a note) when it cannot be made."""
    report = fit_isoflop(points, extrapolated)
    try:
        fit = report.parametric = fit_parametric(points, top_starts=top_starts)
    except KilnError as exc:
        report.notes.append(f"parametric fit: {exc}")
        return report
    if not fit.best_converged:
        report.notes.append(
            f"parametric fit: L-BFGS stopped after {MAX_ITER} iterations without converging; "
            "the runs may not pin down five parameters"
        )
    if fit.at_bounds:
        report.notes.append(
            f"parametric fit: {', '.join(fit.at_bounds)} stopped at the edge of the search box; "
            "the runs do not constrain them"
        )
    return report
