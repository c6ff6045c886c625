"""Reading a large compressed input in many tasks: from the start vs from the byte-offset index.

    python bench/data_offsets.py --tasks 16        # ../shared/data/bench/en_100m.txt.gz

Without an index each task of a gzip file decompresses (and splits into records) everything
before its range, so the file is read about tasks/2 times; with the index built by the counting
pass (`kiln.data.pipeline.read.offsets`: the decompressed bytes re-chunked as zstd frames that start
at the tasks' first records) each task reads only its range. Measured side by side in one
process, one task after another (the sum is the CPU work the pool would share): the counting
pass alone vs the counting pass that also writes the index, then all tasks each way; the
records each way are checked to be equal.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# Run as a script from a plain checkout too (this checkout's kiln, and bench._load).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.data.pipeline.read import offsets
from kiln.data.pipeline.read.readers import ReadIssues, count_records, iter_records
from kiln.tokenizer.special import EOT

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "bench" / "en_100m.txt.gz"


def _read_all(path: str, n: int, per_task: int, index: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    chars = 0
    for start in range(0, n, per_task):
        for doc in iter_records(path, "txt", issues=ReadIssues(), start=start,
                                stop=min(start + per_task, n), index=index):  # fmt: skip
            chars += 0 if doc is None else len(doc.text)
    return time.perf_counter() - t0, chars


def run(path: str, tasks: int) -> dict:
    """Time the count pass and the tasks' reads, without and with the index."""
    t0 = time.perf_counter()
    n = count_records(path, "txt")
    count_s = time.perf_counter() - t0
    per_task = -(-n // tasks)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "index")
        t0 = time.perf_counter()
        assert offsets.build_index(path, "txt", EOT.encode(), per_task, out) == n
        index_s = time.perf_counter() - t0
        copy_mb = Path(out + ".zst").stat().st_size / 1e6
        indexed_s, chars_indexed = _read_all(path, n, per_task, out)
    plain_s, chars_plain = _read_all(path, n, per_task, "")
    assert chars_plain == chars_indexed
    return {
        "file": path,
        "file_mb": round(Path(path).stat().st_size / 1e6, 1),
        "records": n,
        "tasks": tasks,
        "count_pass_s": round(count_s, 1),
        "count_pass_with_index_s": round(index_s, 1),
        "index_copy_mb": round(copy_mb, 1),
        "tasks_from_start_s": round(plain_s, 1),
        "tasks_from_index_s": round(indexed_s, 1),
        "speedup_tasks": round(plain_s / indexed_s, 2),
        "speedup_count_plus_tasks": round((count_s + plain_s) / (index_s + indexed_s), 2),
    }


def main() -> None:
    """Parse arguments, run, print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", default=str(CORPUS))
    parser.add_argument("--tasks", type=int, default=16)
    add_noisy_flag(parser)
    args = parser.parse_args()
    measured = begin("bench/data_offsets.py", args.noisy)
    print(json.dumps(measured.stamp(run(args.file, args.tasks)), indent=2))


if __name__ == "__main__":
    main()
