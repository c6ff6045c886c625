"""How well kiln's scaling-law fitters recover known constants from noisy synthetic runs.

    python bench/scaling_fit.py [--seeds 3] [--starts 64]

Points come from Chinchilla's L(N, D) (Hoffmann et al. 2022) at 5 budgets (1e18..1e22) × 9 sizes
spanning 100× around each optimum, with log-normal noise; for each noise level the worst relative
error over the seeds is printed for E, A, B, alpha, beta and for the exponent of N_opt(C) from
the parametric fit (approach 3) and from the IsoFLOP parabolas (approach 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

# Run as a script from a plain checkout too (this checkout's kiln, and bench._load).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.scaling.fit import Point, fit_all
from kiln.scaling.laws import CHINCHILLA, ScalingLaw


def isoflop_points(law: ScalingLaw, noise: float, seed: int) -> list[Point]:
    """9 sizes spanning 100× around the optimum at each of 5 budgets, log-normal noise."""
    rng = np.random.default_rng(seed)
    points = []
    for c in np.logspace(18, 22, 5):
        n_opt, _ = law.optimal(c)
        for n in n_opt * np.logspace(-1, 1, 9):
            d = c / (6 * n)
            points.append(Point(n, d, c, law.loss(n, d) * float(np.exp(rng.normal(0, noise)))))
    return points


def main() -> None:
    """Fit every (noise, seed) and print the worst relative errors per noise level."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--starts", type=int, default=64)
    add_noisy_flag(parser)
    args = parser.parse_args()
    measured = begin("bench/scaling_fit.py", args.noisy)
    names = ("E", "A", "B", "alpha", "beta")
    print("noise   " + "".join(f"{n:>8}" for n in (*names, "a (3)", "a (2)")))
    for noise in (0.0, 0.005, 0.02):
        worst = dict.fromkeys((*names, "a3", "a2"), 0.0)
        for seed in range(args.seeds):
            report = fit_all(isoflop_points(CHINCHILLA, noise, seed), top_starts=args.starts)
            law = report.parametric.law
            for n in names:
                err = abs(getattr(law, n) / getattr(CHINCHILLA, n) - 1)
                worst[n] = max(worst[n], err)
            worst["a3"] = max(worst["a3"], abs(law.a / CHINCHILLA.a - 1))
            worst["a2"] = max(worst["a2"], abs(report.n_opt.exponent / CHINCHILLA.a - 1))
        print(f"{noise:<8}" + "".join(f"{v:>8.2%}" for v in worst.values()))
    print(measured.line())


if __name__ == "__main__":
    main()
