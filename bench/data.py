"""The data pipeline against datatrove, side by side: quality filters, then MinHash near dedup.

    python bench/data.py [--docs 5000]

Runs bench/data_filters.py and bench/data_dedup.py on the same documents of
../shared/data/bench/en_10m.txt.gz and prints docs per CPU-second for kiln and datatrove, their
ratio, the filters' keep/remove agreement and near-duplicate recall on planted duplicates.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import data_dedup
import data_filters

from bench._load import add_noisy_flag, begin


def main() -> None:
    """Run both benchmarks and print one JSON summary at the end."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=5000)
    add_noisy_flag(parser)
    args = parser.parse_args()
    measured = begin("bench/data.py", args.noisy)
    results = {"filters": data_filters.run(args.docs), "near_dedup": data_dedup.run(args.docs)}
    print(json.dumps(measured.stamp(results), indent=2, default=str))


if __name__ == "__main__":
    main()
