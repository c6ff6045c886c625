"""Kernel tests: Triton's interpreter on machines without CUDA, the compiled kernels with it.

The kernel module is imported by tests/conftest.py (`tests.fixtures.import_kernels`), before any
test module is collected: a test module that imports a library which imports triton (diffusers
does) must not get there first.
"""

import pytest
import torch

_KERNELS = "kiln.kernels.attention_kernels"


@pytest.fixture(scope="session")
def device() -> str:
    """Where the kernel tests put tensors: CPU under the interpreter, else CUDA."""
    kernels = pytest.importorskip(_KERNELS)
    if kernels.INTERPRET:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("kiln.kernels was imported compiled (no TRITON_INTERPRET) and there is no CUDA")
    return "cuda"
