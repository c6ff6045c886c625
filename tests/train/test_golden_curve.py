"""The golden loss curve: 20 steps of the `tiny` preset on a shipped token sample, in fp32 on CPU.

A numerical change anywhere in the model, optimizer, schedule or loader fails here with the first
step whose loss moved. If the change is intended, regenerate the curve (see golden_curve.py).
"""

from __future__ import annotations

import json

from tests.train.golden_curve import CURVE, STEPS, first_difference, pinned_losses

REL = 1e-5  # observed AVX-512 vs AVX2 kernels: under 1e-7; a real change moves far more


# Not in `make test-kernels`: the curve runs in a child process that pins its own kernel
# variables, so the matrix's cells would not change it; the default run covers it.
def test_twenty_steps_reproduce_the_stored_loss_curve() -> None:
    expected = json.loads(CURVE.read_text())["losses"]
    assert len(expected) == STEPS
    actual = pinned_losses()
    diff = first_difference(expected, actual, REL)
    assert diff is None, (
        f"step {diff[0]}: loss {diff[2]!r}, golden {diff[1]!r} (relative tolerance {REL}); "
        "if the change is meant, run `python -m tests.train.golden_curve --write`"
    )


def test_first_difference_names_the_first_step_off() -> None:
    curve = [6.0, 5.0, 4.0, 3.0]
    assert first_difference(curve, [6.0, 5.0 * (1 + 1e-6), 4.0, 3.0], REL) is None
    assert first_difference(curve, [6.0, 5.0, 4.01, 3.5], REL) == (3, 4.0, 4.01)
    assert first_difference(curve, curve[:3], REL)[0] == 4
