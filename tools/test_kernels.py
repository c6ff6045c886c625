"""Rerun the kernel-sensitive tests (pytest marker `kernels`) under each CPU-kernel setting.

Each cell of (kernel setting × torch threads) is its own pytest process, since MKL, oneDNN and
ATen read their environment variables once, at load. Prints a table of tests × cells and exits 1
if any cell fails. `make test-kernels` runs the CI cells; docs/testing.md says what they mean.

    python tools/test_kernels.py [--threads 1,2] [--extra] [--only NAME,...] [-- PYTEST_ARGS]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The kernel choices a CPU makes for itself, forced one at a time on this machine: ATen's
# vectorised ops (AVX-512 / AVX2 / scalar), MKL's GEMMs, oneDNN's ISA, MKL's conditional
# numerical reproducibility mode.
CI_CELLS: dict[str, dict[str, str]] = {
    "default": {},
    "aten=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten=default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl=AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "onednn=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "cbwr=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
}
# The closest an AMD machine gets to an Intel one's MKL kernels; not run in CI.
EXTRA_CELLS: dict[str, dict[str, str]] = {
    "mkl_cpu=5": {"MKL_DEBUG_CPU_TYPE": "5"},
    "mkl=AVX512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}
# Variables a cell sets, cleared from the caller's environment so every cell starts the same.
KERNEL_VARS = sorted(
    {k for cells in (CI_CELLS, EXTRA_CELLS) for env in cells.values() for k in env}
)


def parse_threads(text: str) -> list[int]:
    """`--threads 1,2` as [1, 2]; a clear error for anything else."""
    try:
        threads = [int(t) for t in text.split(",")]
    except ValueError:
        threads = []
    if not threads or min(threads) < 1:
        raise SystemExit(f"--threads {text!r}: expected comma-separated whole numbers >= 1")
    return threads


def kernel_test_files() -> list[str]:
    """The test files that hold `kernels` tests: those that mark one, and those that
    tests/conftest.py's KERNEL_SENSITIVE names (a text scan: collecting the whole suite to find
    them would cost more than a cell)."""
    tests = ROOT / "tests"
    files = {p for p in tests.rglob("test_*.py") if "pytest.mark.kernels" in p.read_text("utf-8")}
    conftest = (tests / "conftest.py").read_text("utf-8")
    files |= {ROOT / m for m in re.findall(r'"(tests/[^":]+\.py)::', conftest)}
    if not files:
        raise SystemExit("no test file marks a `kernels` test (pytest.mark.kernels)")
    return sorted(str(f.relative_to(ROOT)) for f in files)


def start_cell(
    env_over: dict[str, str], threads: int, junit: Path, pytest_args: list[str], log: Path
) -> subprocess.Popen[bytes]:
    """Start one pytest process over the `kernels` tests, its output into `log`."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARS}
    env.update(env_over)
    env["KILN_TEST_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [
        sys.executable, "-m", "pytest", "-q", "-m", "kernels", "-p", "no:cacheprovider",
        f"--junitxml={junit}", *pytest_args,
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def outcomes(junit: Path) -> dict[str, str]:
    """Test id -> 'pass' / 'FAIL' / 'skip' from a JUnit XML report (empty if there is none)."""
    if not junit.exists():
        return {}
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        result[name] = (
            "FAIL" if tags & {"failure", "error"} else "skip" if "skipped" in tags else "pass"
        )
    return result


def main(argv: list[str]) -> int:
    """Run every cell, print the table, return 1 if any cell failed."""
    split = argv.index("--") if "--" in argv else len(argv)
    ours, pytest_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="torch threads per cell (default 1,2)")
    parser.add_argument("--extra", action="store_true", help="add the non-CI MKL cells")
    parser.add_argument("--only", default="", help="comma-separated cell names to run")
    parser.add_argument(
        "--jobs", type=int, default=2, help="one-thread cells run at once (default 2)"
    )
    args = parser.parse_args(ours)
    threads = parse_threads(args.threads)
    cells = {**CI_CELLS, **(EXTRA_CELLS if args.extra else {})}
    if args.only:
        wanted = args.only.split(",")
        unknown = [n for n in wanted if n not in {**CI_CELLS, **EXTRA_CELLS}]
        if unknown:
            known = ", ".join([*CI_CELLS, *EXTRA_CELLS])
            raise SystemExit(f"--only: unknown cell(s) {', '.join(unknown)}; known: {known}")
        cells = {n: {**CI_CELLS, **EXTRA_CELLS}[n] for n in wanted}

    columns: list[str] = []
    results: dict[str, dict[str, str]] = {}
    summary: list[tuple[str, int, float]] = []
    start = time.perf_counter()
    if not any(not a.startswith("-") for a in pytest_args):  # no paths given: the marked files
        pytest_args = [*kernel_test_files(), *pytest_args]
    # One-thread cells run two at a time (one per core of the 2-core CI machine); others alone.
    plan = [(f"{name}/t{t}", env, t) for t in threads for name, env in cells.items()]
    waves: list[list[tuple[str, dict[str, str], int]]] = []
    for cell in plan:
        if cell[2] == 1 and waves and len(waves[-1]) < args.jobs and waves[-1][0][2] == 1:
            waves[-1].append(cell)
        else:
            waves.append([cell])
    with tempfile.TemporaryDirectory() as tmp:
        for wave in waves:
            running = []
            for column, env, t in wave:
                print(f"== {column}: {env or 'no kernel variables'}", flush=True)
                index = len(columns)
                columns.append(column)
                junit, log = Path(tmp) / f"{index}.xml", Path(tmp) / f"{index}.log"
                running.append((column, junit, log, time.perf_counter(),
                                start_cell(env, t, junit, pytest_args, log)))  # fmt: skip
            for column, junit, log, began, proc in running:
                code = proc.wait()
                summary.append((column, code, time.perf_counter() - began))
                if code != 0:
                    print(f"-- {column} failed; its output:\n{log.read_text(errors='replace')}")
                for test, outcome in outcomes(junit).items():
                    results.setdefault(test, {})[column] = outcome
    total = time.perf_counter() - start

    print("\nkernel-sensitive tests × cells (columns numbered below)")
    width = max([len(t) for t in results] or [4])
    print(f"{'test':<{width}}  " + " ".join(f"{i + 1:>4}" for i in range(len(columns))))
    for test in sorted(results):
        row = results[test]
        print(f"{test:<{width}}  " + " ".join(f"{row.get(c, '-'):>4}" for c in columns))
    print()
    for i, (column, code, seconds) in enumerate(summary):
        verdict = "pass" if code == 0 else f"FAIL (pytest exit {code})"
        print(f"{i + 1:>3} {column:<22} {verdict:<22} {seconds:6.1f} s")
    failed = [column for column, code, _ in summary if code != 0]
    print(f"{len(summary) - len(failed)}/{len(summary)} cells passed in {total:.0f} s")
    outcomes_all = [o for row in results.values() for o in row.values()]
    # The plain closing line CI reads: test runs over all cells.
    print(f"kernels: {outcomes_all.count('pass')} passed, {outcomes_all.count('FAIL')} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
