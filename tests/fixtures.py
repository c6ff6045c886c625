"""Building blocks shared by several test directories' conftest files."""

from __future__ import annotations

import gzip
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

EOT = "<|endoftext|>"
BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_script(name: str, alias: str) -> ModuleType:
    """bench/<name>.py loaded as module `alias` (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(alias, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def require_shared(path: Path) -> Path:
    """`path` under the shared data folder; skip when it is missing, or fail under
    KILN_REQUIRE_SHARED=1 (`make test`), so a green run cannot hide the tests that need it."""
    import pytest

    if path.exists():
        return path
    if os.environ.get("KILN_REQUIRE_SHARED") == "1":
        pytest.fail(f"shared data not found at {path} (KILN_REQUIRE_SHARED=1: it is required)")
    pytest.skip(f"shared data not found at {path}")


def kiln_test_threads() -> int:
    """Torch intra-op threads for the tests: KILN_TEST_THREADS (default 1; `make test-kernels`
    runs the kernel-sensitive tests under 1 and 2)."""
    raw = os.environ.get("KILN_TEST_THREADS", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"KILN_TEST_THREADS={raw!r}: expected a whole number of threads, >= 1")
    return int(raw)


def thread_counts() -> list[int]:
    """The torch thread counts a test that varies them should try: KILN_TEST_THREADS alone when
    `make test-kernels` sets it (each matrix cell is one count), else 1 and 2."""
    return [kiln_test_threads()] if "KILN_TEST_THREADS" in os.environ else [1, 2]


def single_torch_thread() -> Iterator[None]:
    """Run a test with KILN_TEST_THREADS intra-op threads, one by default: tiny models gain
    nothing from more, sums stay ordered and the 2-core machine is not oversubscribed (wrap with
    pytest.fixture(autouse=True))."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(kiln_test_threads())
    yield
    torch.set_num_threads(before)


def tiny_story_dataset(source: Path, root: Path, n_chars: int, val_docs: int = 4) -> Path:
    """The first `n_chars` of a TinyStories file (whole stories) as a 300-token BPE and shards."""
    from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
    from kiln.tokenizer import train_bpe

    with gzip.open(source, "rt", encoding="utf-8") as handle:
        text = handle.read(n_chars)
    text = text[: text.rfind(EOT) + len(EOT)]  # whole stories only
    corpus = root / "stories.txt"
    corpus.write_text(text, encoding="utf-8")
    train_bpe(corpus, 300, special_tokens=[EOT], workers=1).save(root / "tok.json")
    out = root / "shards"
    tokenize_to_shards(
        TokenizeConfig(
            tokenizer=str(root / "tok.json"), inputs=(str(corpus),), out=str(out),
            val_docs=val_docs, workers=1, progress=False,
        )
    )  # fmt: skip
    return out


def dead_pid() -> int:
    """The PID of a process that has exited (what a killed run's leftovers are named with)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(done.stdout)


def live_process() -> Iterator[int]:
    """The PID of another live process for the test's duration (wrap with pytest.fixture).

    Not the test's own PID: a cleanup at a command's start takes our own PID for a dead
    predecessor's (PIDs repeat in containers).
    """
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait()


KERNELS_MODULE = "kiln.kernels.attention_kernels"


def import_kernels() -> None:
    """Import kiln's Triton kernels, interpreted unless CUDA is present or the user chose.

    Triton decides interpreted-or-compiled when a kernel is decorated (its own library functions
    too, when triton is first imported), so TRITON_INTERPRET is set around the first import of
    triton and the kernel module, then removed: the rest of the pytest process (subprocesses too)
    never sees it in the environment. Triton's in-process knob stays on, so its lazily imported
    parts agree; that matters only to code that runs Triton kernels, without CUDA kiln.kernels.
    """
    import importlib
    import importlib.util
    import sys

    import torch

    if importlib.util.find_spec("triton") is None or KERNELS_MODULE in sys.modules:
        return
    if "TRITON_INTERPRET" in os.environ or torch.cuda.is_available():
        importlib.import_module(KERNELS_MODULE)
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        importlib.import_module(KERNELS_MODULE)
    finally:
        del os.environ["TRITON_INTERPRET"]
    triton.knobs.runtime.interpret = True
