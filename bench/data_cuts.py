"""Near dedup after decontamination cuts: are cut copies of a kept document still caught?

    python bench/data_cuts.py --docs 200

Planted corpus: real documents of ../shared/data/bench/en_10m.txt.gz (1,200-3,000 characters)
and, for each, a copy with k HellaSwag validation passages (k = 1..5, context + gold ending)
pasted at its end. Decontamination cuts the passages out (with the window before them), so the
copy becomes a prefix of the original. For each k: the share of copies that share an LSH band
(14 x 8, word 5-grams) with their original when the fingerprints are taken on the text as read
(before cuts) and on the text after cuts (what kiln does), and the mean true 5-gram Jaccard.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import json
import sys
from pathlib import Path

import numpy as np

# Run as a script from a plain checkout too (this checkout's kiln, and bench._load).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.data.pipeline.decontaminate.ngram_overlap import DecontamConfig, Decontaminator
from kiln.data.pipeline.dedup.minhash import MinHashConfig, MinHasher, hash_word_ngrams
from kiln.data.pipeline.document import Document

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
EOT_LINE = "\n<|endoftext|>\n"


def _passages(n: int) -> list[str]:
    with bz2.open(DATA / "eval" / "hellaswag_val.txt.bz2", "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    out = []
    for k in range(n):
        item = lines[6 * k : 6 * k + 6]
        out.append(f"{item[0].split(': ', 1)[1]} {item[2 + int(item[1])].strip()}")
    return out


def _jaccard(a: str, b: str) -> float:
    x, y = (set(hash_word_ngrams([t], 5)[0].tolist()) for t in (a, b))
    return len(x & y) / max(len(x | y), 1)


def run(n_docs: int) -> dict:
    """For k = 1..5 passages: caught before / after cuts, mean Jaccard each way."""
    with gzip.open(DATA / "bench" / "en_10m.txt.gz", "rt", encoding="utf-8") as f:
        docs = [d for d in f.read(6_000_000).split(EOT_LINE) if len(d) >= 1200][:n_docs]
    docs = [d[: d.rfind(" ", 0, 3000)] if len(d) > 3000 else d for d in docs]
    passages = _passages(5 * n_docs)
    stage = Decontaminator(
        DecontamConfig(eval_files=(str(DATA / "eval" / "hellaswag_val.txt.bz2"),))
    )
    hasher = MinHasher(MinHashConfig())
    results = {}
    for k in range(1, 6):
        copies = [f"{d}\n" + "\n".join(passages[5 * i : 5 * i + k]) for i, d in enumerate(docs)]
        cut = [Document(str(i), c, "bench", {}) for i, c in enumerate(copies)]
        verdicts = stage.apply_batch(cut)
        kept = [i for i, v in enumerate(verdicts) if v is None]
        row = {}
        for name, texts in (("before_cuts", copies), ("after_cuts", [d.text for d in cut])):
            a = hasher.band_keys(hasher.signatures([docs[i] for i in kept]))
            b = hasher.band_keys(hasher.signatures([texts[i] for i in kept]))
            row[f"caught_{name}"] = round(float(np.mean(np.any(a == b, axis=1))), 3)
            row[f"jaccard_{name}"] = round(
                float(np.mean([_jaccard(docs[i], texts[i]) for i in kept])), 3
            )
        row["copies"] = len(kept)
        results[f"{k} passage{'s' if k > 1 else ''}"] = row
    return results


def main() -> None:
    """Parse arguments, run, print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=200)
    add_noisy_flag(parser)
    args = parser.parse_args()
    measured = begin("bench/data_cuts.py", args.noisy)
    print(json.dumps(measured.stamp(run(args.docs)), indent=2))


if __name__ == "__main__":
    main()
