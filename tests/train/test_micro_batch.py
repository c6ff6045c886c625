"""batch.micro_batch = "auto": the largest divisor that fits, found by a probe; CUDA only."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import KilnError
from kiln.train.micro_batch import candidates, largest_that_fits
from kiln.train.trainer import Trainer

from .conftest import MakeConfig


def test_the_largest_micro_batch_that_fits_keeps_the_global_batch_exact() -> None:
    assert candidates(12) == [12, 6, 4, 3, 2, 1]
    tried = []

    def fits(size: int) -> bool:
        tried.append(size)
        if size > 4:
            raise torch.OutOfMemoryError("probe")
        return size <= 3

    assert largest_that_fits(candidates(12), fits) == 3
    assert tried == [12, 6, 4, 3]
    with pytest.raises(KilnError, match="not even a micro-batch of 1"):
        largest_that_fits([2, 1], lambda size: False)


def test_auto_micro_batch_on_a_cpu_is_a_clear_error(make_config: MakeConfig) -> None:
    with pytest.raises(KilnError, match=r"'auto' probes GPU memory; on cpu give a number"):
        Trainer(make_config("batch.micro_batch=auto"), make_config().logging.run_dir)
