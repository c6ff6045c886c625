"""Kernel tests: Triton's interpreter on machines without CUDA, the compiled kernels with it.

Triton decides interpreted-or-compiled when a kernel is decorated (its own library functions
too, when triton is first imported), so TRITON_INTERPRET is set here, at collection, around the
first import of triton and the kernel module, then removed: the rest of the pytest process
(other test directories, subprocesses) never sees it in the environment. Triton's in-process
knob stays on, so the lazily imported parts of triton agree; that only matters to code that
runs Triton kernels, which without CUDA is kiln.kernels alone.
"""

import importlib.util
import os
import sys

import pytest
import torch

_KERNELS = "kiln.kernels.attention_kernels"


def _import_kernels() -> None:
    """Import the kernel module, interpreted unless CUDA is present or the user chose."""
    if importlib.util.find_spec("triton") is None or _KERNELS in sys.modules:
        return
    interpret = "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available()
    if not interpret:
        importlib.import_module(_KERNELS)
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        importlib.import_module(_KERNELS)
    finally:
        del os.environ["TRITON_INTERPRET"]
    triton.knobs.runtime.interpret = True


_import_kernels()


@pytest.fixture(scope="session")
def device() -> str:
    """Where the kernel tests put tensors: CPU under the interpreter, else CUDA."""
    kernels = pytest.importorskip(_KERNELS)
    if kernels.INTERPRET:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("kiln.kernels was imported compiled (no TRITON_INTERPRET) and there is no CUDA")
    return "cuda"
