"""Scaling-fit figures (matplotlib, Agg): IsoFLOP curves, optimal-size frontiers, fit quality."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.plotting import pyplot, save_png
from kiln.scaling.fit import FitReport, Point, by_budget


def plot_isoflop(points: list[Point], report: FitReport, path: Path) -> Path:
    """Loss against N per budget, with each budget's parabola and its vertex."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    groups = by_budget(points)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(1, len(groups))))
    parabolas = {p.budget: p for p in report.parabolas}
    for color, (budget, group) in zip(colors, groups.items(), strict=True):
        n = np.array([p.n for p in group])
        ax.scatter(n, [p.loss for p in group], color=color, label=f"C = {budget:.2g}", zorder=3)
        fit = parabolas.get(budget)
        if fit is None:
            continue
        x = np.linspace(np.log10(n.min()) - 0.15, np.log10(n.max()) + 0.15, 100)
        ax.plot(10**x, fit.k2 * x**2 + fit.k1 * x + fit.k0, color=color, lw=1)
        if fit.has_minimum:
            ax.scatter([fit.n_opt], [fit.loss_opt], color=color, marker="*", s=150,
                       edgecolor="black", zorder=4)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("IsoFLOP curves (★ parabola minimum)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return save_png(fig, path, dpi=120)


def plot_frontier(report: FitReport, path: Path) -> Path:
    """N_opt and D_opt against C: the parabola vertices, their power laws, the parametric law."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    good = [p for p in report.parabolas if p.has_minimum]
    budgets = [p.budget for p in report.parabolas] or [1.0]
    c = np.logspace(np.log10(min(budgets)) - 0.5, np.log10(max(budgets)) + 0.5, 50)
    for ax, which in zip(axes, ("N", "D"), strict=True):
        used = set(report.power_law_budgets)
        for in_law, label, face in ((True, "IsoFLOP minima", "black"),
                                    (False, "extrapolated minima (not fitted)", "none")):  # fmt: skip
            chosen = [p for p in good if (p.budget in used) == in_law]
            if not chosen:
                continue
            b = np.array([p.budget for p in chosen])
            n = np.array([p.n_opt for p in chosen])
            ax.scatter(b, n if which == "N" else b / (6 * n), facecolor=face, edgecolor="black",
                       zorder=3, label=label)  # fmt: skip
        law = report.n_opt if which == "N" else report.d_opt
        if law is not None:
            ax.plot(c, law(c), label=f"power law: ∝ C^{law.exponent:.3f}")
        if report.parametric is not None:
            fit = report.parametric.law
            opt = np.array([fit.optimal(x) for x in c])
            ax.plot(c, opt[:, 0 if which == "N" else 1], ls="--",
                    label=f"parametric: ∝ C^{fit.a if which == 'N' else fit.b:.3f}")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("compute C (FLOPs, 6·N·D)")
        ax.set_ylabel("optimal parameters N" if which == "N" else "optimal tokens D")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("Compute-optimal frontier")
    return save_png(fig, path, dpi=120)


def plot_predicted(points: list[Point], report: FitReport, path: Path) -> Path:
    """Parametric-law prediction against the observed loss, one point per run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    if report.parametric is not None:
        fit = report.parametric.law
        groups = by_budget(points)
        colors = plt.cm.viridis(np.linspace(0, 0.9, len(groups)))
        for color, (budget, group) in zip(colors, groups.items(), strict=True):
            ax.scatter([p.loss for p in group], [fit.loss(p.n, p.d) for p in group],
                       color=color, label=f"C = {budget:.2g}")  # fmt: skip
        observed = np.array([p.loss for p in points])
        predicted = np.array([fit.loss(p.n, p.d) for p in points])
        lo, hi = min(observed.min(), predicted.min()), max(observed.max(), predicted.max())
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1, label="y = x")
        ax.set_title(f"L(N, D) fit: RMSE of log L = {report.parametric.rmse_log:.4f}")
        ax.legend(fontsize=8)
    else:
        ax.set_title("no parametric fit")
    ax.set_xlabel("observed loss")
    ax.set_ylabel("predicted loss")
    ax.grid(alpha=0.3)
    return save_png(fig, path, dpi=120)


FIGURES = ("isoflop.png", "frontier.png", "predicted.png")


def plot_all(points: list[Point], report: FitReport, out: Path, prefix: str = "") -> list[Path]:
    """The three FIGURES under `out`, each name with `prefix` in front."""
    isoflop, frontier, predicted = (out / f"{prefix}{name}" for name in FIGURES)
    return [
        plot_isoflop(points, report, isoflop),
        plot_frontier(report, frontier),
        plot_predicted(points, report, predicted),
    ]
