"""Scaling: parameter, FLOP and memory accounting, compute-optimal plans, sweeps and law fits."""
