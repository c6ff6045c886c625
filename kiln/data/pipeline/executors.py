"""Where pipeline tasks run: this process, a local process pool, or a Ray cluster.

Every executor runs the same module-level task functions; tasks write their results to the run
directory (a shared file system on a cluster) and return only small summaries, so the output
does not depend on which executor ran them or in what order they finished.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from tqdm import tqdm

from kiln.data.procs import stop_pool, worker_init
from kiln.errors import KilnError
from kiln.fault_points import wait_point


class Executor(Protocol):
    """Runs `fn(task)` for every task; yields (task index, result) as they complete."""

    def map(
        self,
        fn: Callable[[Any], Any],
        tasks: Sequence[Any],
        desc: str,
        unit: str = "task",
        sizes: Sequence[int] | None = None,
    ) -> Iterator[tuple[int, Any]]:
        """Run all tasks; yield each one's index and result as it finishes.

        With `sizes` (say, records per task) the progress bar counts those instead of tasks.
        """
        ...

    def close(self) -> None:
        """Release workers."""
        ...


class _Bar:
    """A tqdm bar over tasks, or over their sizes when given."""

    def __init__(
        self, n: int, sizes: Sequence[int] | None, desc: str, unit: str, progress: bool
    ) -> None:
        self.sizes = sizes
        total = sum(sizes) if sizes is not None else n
        self.bar = tqdm(total=total, desc=desc, unit=unit, disable=not progress, dynamic_ncols=True)

    def done(self, i: int) -> None:
        """Advance past task i."""
        self.bar.update(self.sizes[i] if self.sizes is not None else 1)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


@dataclass
class LocalExecutor:
    """`workers` processes (fork on Linux); with one worker, tasks run in this process."""

    workers: int = 1
    progress: bool = True

    def map(
        self,
        fn: Callable[[Any], Any],
        tasks: Sequence[Any],
        desc: str,
        unit: str = "task",
        sizes: Sequence[int] | None = None,
    ) -> Iterator[tuple[int, Any]]:
        """Run all tasks; yield each one's index and result as it finishes."""
        with _Bar(len(tasks), sizes, desc, unit, self.progress) as bar:
            if self.workers <= 1 or len(tasks) <= 1:
                for i, task in enumerate(tasks):
                    result = fn(task)
                    bar.done(i)
                    yield i, result
                return
            context = (
                multiprocessing.get_context("fork")
                if sys.platform == "linux"
                else multiprocessing.get_context("spawn")
            )
            pool = ProcessPoolExecutor(
                self.workers, mp_context=context, initializer=worker_init, initargs=(os.getpid(),)
            )
            try:
                futures: dict[Future[Any], int] = {
                    pool.submit(_pool_task, fn, task): i for i, task in enumerate(tasks)
                }
                pending = set(futures)
                while pending:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in sorted(done, key=futures.__getitem__):
                        bar.done(futures[fut])
                        yield futures[fut], fut.result()
            except BaseException:
                # Interrupted, failed, or abandoned by the caller: tasks not yet finished are
                # redone by the next run (only finished ones leave markers), so stop now.
                stop_pool(pool)
                raise
            pool.shutdown()

    def close(self) -> None:
        """Nothing to release: pools live only inside `map`."""


def _pool_task(fn: Callable[[Any], Any], task: Any) -> Any:
    """Run one task in a pool worker; the tests' hook may hold the worker after it."""
    result = fn(task)
    wait_point("pool:task-done")
    return result


class RayExecutor:
    """Tasks as Ray remote functions, on the cluster at `address` or a local Ray instance."""

    def __init__(self, address: str | None, workers: int | None, progress: bool = True) -> None:
        try:
            import ray
        except ImportError:
            raise KilnError(
                "--executor ray needs Ray: pip install 'kiln[ray]' (or pip install ray)"
            ) from None
        self._ray = ray
        self.progress = progress
        self._owns = not ray.is_initialized()
        if self._owns:
            kwargs: dict[str, Any] = {"ignore_reinit_error": True, "log_to_driver": False}
            if address:
                kwargs["address"] = address
            elif workers:
                kwargs["num_cpus"] = workers
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError) as exc:
                raise KilnError(
                    f"cannot start or reach Ray at {address or 'local'}: {exc}"
                ) from None

    def map(
        self,
        fn: Callable[[Any], Any],
        tasks: Sequence[Any],
        desc: str,
        unit: str = "task",
        sizes: Sequence[int] | None = None,
    ) -> Iterator[tuple[int, Any]]:
        """Run all tasks as Ray tasks; yield each one's index and result as it finishes."""
        remote = self._ray.remote(fn)
        refs = {remote.remote(task): i for i, task in enumerate(tasks)}
        pending = list(refs)
        with _Bar(len(tasks), sizes, desc, unit, self.progress) as bar:
            while pending:
                done, pending = self._ray.wait(pending, num_returns=1)
                for ref in done:
                    bar.done(refs[ref])
                    yield refs[ref], self._ray.get(ref)

    def close(self) -> None:
        """Shut Ray down if this executor started it."""
        if self._owns:
            self._ray.shutdown()


def make_executor(
    kind: str, workers: int, address: str | None = None, progress: bool = True
) -> Executor:
    """The executor named by `--executor` (local or ray)."""
    if kind == "local":
        return LocalExecutor(workers, progress)
    if kind == "ray":
        return RayExecutor(address, workers, progress)
    raise KilnError(f"--executor {kind!r}: expected 'local' or 'ray'")
