"""Fixtures for the model tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same global RNG state."""
    torch.manual_seed(0)
