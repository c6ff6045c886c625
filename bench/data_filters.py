"""Benchmark kiln's quality filters side by side with datatrove's on the same documents.

Filters: Gopher quality, Gopher repetition, C4, FineWeb; kiln's stages against datatrove's
GopherQualityFilter, GopherRepetitionFilter, C4QualityFilter and FineWebQualityFilter, in one
process, on the first N documents of en_10m.txt.gz. Reported per filter: documents per
CPU-second (time.process_time around the filter calls only; documents are built beforehand,
nothing is written), the ratio kiln/datatrove, and how often the keep/remove decisions agree.
Then the four filters chained per document, as a pipeline runs them.

Both sides get the same thresholds: kiln's published defaults, passed to datatrove where its
defaults differ (C4: 3 sentences and 5 words per line), and kiln set where datatrove has no
switch (C4 end marks include "'", FineWeb's newline/word rule on at 0.3).

datatrove's English word tokenizer is spaCy's, which is not installed here (and NLTK's Punkt
data cannot be downloaded offline), so datatrove runs with a stand-in: `nltk` (the default)
is NLTK's word tokenizer over an untrained Punkt sentence splitter, i.e. nltk.word_tokenize
without its trained abbreviation list; `whitespace` is str.split with a regex sentence splitter,
the cheapest tokenizer datatrove could have, so its timings bound datatrove's speed from above.

    python bench/data_filters.py                    # 5,000 documents, both peer tokenizers
    python bench/data_filters.py --docs 500 --peer-tokenizers nltk      # quick look
"""

from __future__ import annotations

import argparse
import gc
import gzip
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Run as a script from a plain checkout too.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._load import add_noisy_flag, begin  # noqa: E402

CORPUS = REPO.parent / "shared" / "data" / "bench" / "en_10m.txt.gz"
EOT_LINE = "<|endoftext|>"
FILTERS = ("gopher_quality", "gopher_repetition", "c4", "fineweb")
PEER_TOKENIZERS = ("nltk", "whitespace")
WARMUP_DOCS = 20


# ------------------------------------------------------------------------------------ corpus
def load_docs(n_docs: int, path: Path = CORPUS) -> list[str]:
    """The first `n_docs` non-empty documents of a corpus with `<|endoftext|>` separator lines."""
    docs: list[str] = []
    lines: list[str] = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.rstrip("\n") == EOT_LINE:
                if text := "".join(lines).strip():
                    docs.append(text)
                    if len(docs) == n_docs:
                        return docs
                lines = []
            else:
                lines.append(line)
    if text := "".join(lines).strip():
        docs.append(text)
    return docs[:n_docs]


# -------------------------------------------------------------------------- the two sides
def kiln_filters() -> dict[str, Any]:
    """kiln's four stages, configured as the benchmark compares them (see the module doc)."""
    from kiln.data.pipeline.filter.quality_c4 import C4Config, C4Filter
    from kiln.data.pipeline.filter.quality_fineweb import FineWebConfig, FineWebFilter
    from kiln.data.pipeline.filter.quality_gopher import (
        GopherQuality,
        GopherQualityConfig,
        GopherRepetition,
        GopherRepetitionConfig,
    )

    return {
        "gopher_quality": GopherQuality(GopherQualityConfig()),
        "gopher_repetition": GopherRepetition(GopherRepetitionConfig()),
        "c4": C4Filter(C4Config(end_marks=(".", "?", "!", '"', "'"))),
        "fineweb": FineWebFilter(FineWebConfig(max_newline_token_ratio=0.3)),
    }


def peer_tokenizer(kind: str) -> Any:
    """A datatrove WordTokenizer that needs no download (see the module doc)."""
    import re

    from datatrove.utils.word_tokenizers import WordTokenizer, strip_strings

    class NLTKOffline(WordTokenizer):
        """nltk.word_tokenize's algorithm with an untrained Punkt model (no nltk_data)."""

        def __init__(self) -> None:
            from nltk.tokenize import NLTKWordTokenizer, PunktSentenceTokenizer

            super().__init__("en")
            self._sentences = PunktSentenceTokenizer()
            self._words = NLTKWordTokenizer()

        def word_tokenize(self, text: str) -> list[str]:
            return strip_strings(
                [w for s in self._sentences.tokenize(text) for w in self._words.tokenize(s)]
            )

        def sent_tokenize(self, text: str) -> list[str]:
            return strip_strings(self._sentences.tokenize(text))

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return list(self._sentences.span_tokenize(text))

    class Whitespace(WordTokenizer):
        """str.split words; sentences end at . ! ? followed by whitespace."""

        _end = re.compile(r"(?<=[.!?])\s+")

        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> list[str]:
            return strip_strings(self._end.split(text))

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            spans, start = [], 0
            for m in self._end.finditer(text):
                spans.append((start, m.start()))
                start = m.end()
            if start < len(text):
                spans.append((start, len(text)))
            return spans

    return {"nltk": NLTKOffline, "whitespace": Whitespace}[kind]()


def datatrove_filters(tokenizer: Any) -> dict[str, Any]:
    """datatrove's four filters with kiln's thresholds and the given word tokenizer."""
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    return {
        "gopher_quality": GopherQualityFilter(language=tokenizer),
        "gopher_repetition": GopherRepetitionFilter(language=tokenizer),
        "c4": C4QualityFilter(language=tokenizer, min_num_sentences=3, min_words_per_line=5),
        "fineweb": FineWebQualityFilter(language=tokenizer),
    }


def kiln_docs(texts: Sequence[str]) -> list[Any]:
    """Fresh kiln Documents (C4 rewrites text, so each run gets its own)."""
    from kiln.data.pipeline.document import Document

    return [Document(id=str(i), text=t, source="bench", meta={}) for i, t in enumerate(texts)]


def datatrove_docs(texts: Sequence[str]) -> list[Any]:
    """Fresh datatrove Documents."""
    from datatrove.data import Document

    return [Document(text=t, id=str(i)) for i, t in enumerate(texts)]


def kiln_keep(result: str | None) -> bool:
    """kiln's stage result as keep/remove."""
    return result is None


def datatrove_keep(result: Any) -> bool:
    """datatrove's filter result (bool or (False, reason)) as keep/remove."""
    return bool(result[0] if isinstance(result, tuple) else result)


def _clear_datatrove_cache() -> None:
    # datatrove memoises the last 5 word splits; start every timed run from an empty cache.
    from datatrove.utils.text import split_into_parts

    split_into_parts.cache_clear()


# ------------------------------------------------------------------------------ measuring
def timed(fn: Callable[[Any], Any], docs: list[Any]) -> tuple[float, list[Any]]:
    """(CPU seconds, results) of fn over docs."""
    gc.collect()
    start = time.process_time()
    results = [fn(d) for d in docs]
    return time.process_time() - start, results


def compare_filter(name: str, texts: Sequence[str], kiln: Any, peer: Any) -> dict[str, Any]:
    """Time one filter on both sides over the same texts; count agreeing decisions."""
    for d in kiln_docs(texts[:WARMUP_DOCS]):
        kiln.apply(d)
    for d in datatrove_docs(texts[:WARMUP_DOCS]):
        peer.filter(d)
    kdocs, pdocs = kiln_docs(texts), datatrove_docs(texts)
    k_cpu, k_res = timed(kiln.apply, kdocs)
    _clear_datatrove_cache()
    p_cpu, p_res = timed(peer.filter, pdocs)
    k_keep = [kiln_keep(r) for r in k_res]
    p_keep = [datatrove_keep(r) for r in p_res]
    n = len(texts)
    both_kept = [i for i in range(n) if k_keep[i] and p_keep[i]]
    out = {
        "filter": name,
        **_speed_and_agreement(k_cpu, p_cpu, k_keep, p_keep),
        "kiln_removed": n - sum(k_keep),
        "datatrove_removed": n - sum(p_keep),
        "only_kiln_removed": sum(p and not k for k, p in zip(k_keep, p_keep, strict=True)),
        "only_datatrove_removed": sum(k and not p for k, p in zip(k_keep, p_keep, strict=True)),
        "kiln_reasons": dict(Counter(r for r in k_res if r is not None).most_common()),
        "datatrove_reasons": dict(
            Counter(r[1] for r in p_res if isinstance(r, tuple)).most_common()
        ),
    }
    if name == "c4" and both_kept:
        same = sum(kdocs[i].text == pdocs[i].text for i in both_kept)
        out["c4_same_text_when_both_keep"] = same / len(both_kept)
    return out


def _speed_and_agreement(
    k_cpu: float, p_cpu: float, k_keep: Sequence[bool], p_keep: Sequence[bool]
) -> dict[str, Any]:
    """Docs per CPU-second on both sides, their ratio, and how often the verdicts agree."""
    n = len(k_keep)
    return {
        "docs": n,
        "kiln_cpu_s": k_cpu,
        "datatrove_cpu_s": p_cpu,
        "kiln_docs_per_cpu_s": n / k_cpu,
        "datatrove_docs_per_cpu_s": n / p_cpu,
        "speed_ratio": p_cpu / k_cpu,
        "agreement": sum(a == b for a, b in zip(k_keep, p_keep, strict=True)) / n,
    }


def compare_chain(texts: Sequence[str], kiln: dict[str, Any], peer: dict[str, Any]) -> dict:
    """The four filters per document in pipeline order, stopping at the first removal."""
    k_stages = [kiln[f] for f in FILTERS]
    p_stages = [peer[f] for f in FILTERS]

    def run_kiln(doc: Any) -> bool:
        return all(s.apply(doc) is None for s in k_stages)

    def run_peer(doc: Any) -> bool:
        return all(datatrove_keep(s.filter(doc)) for s in p_stages)

    k_cpu, k_keep = timed(run_kiln, kiln_docs(texts))
    _clear_datatrove_cache()
    p_cpu, p_keep = timed(run_peer, datatrove_docs(texts))
    return {
        **_speed_and_agreement(k_cpu, p_cpu, k_keep, p_keep),
        "kiln_kept": sum(k_keep),
        "datatrove_kept": sum(p_keep),
    }


def run(n_docs: int = 5000, peer_tokenizers: Sequence[str] = PEER_TOKENIZERS) -> dict:
    """Run the side-by-side benchmark; returns every number it prints."""
    from importlib.metadata import version

    texts = load_docs(n_docs)
    kiln = kiln_filters()
    result: dict[str, Any] = {
        "corpus": CORPUS.name,
        "docs": len(texts),
        "chars": sum(map(len, texts)),
        "python": platform.python_version(),
        "datatrove": version("datatrove"),
        "nltk": version("nltk"),
        "runs": {},
    }
    for kind in peer_tokenizers:
        peer = datatrove_filters(peer_tokenizer(kind))
        filters = [compare_filter(f, texts, kiln[f], peer[f]) for f in FILTERS]
        k_total = sum(r["kiln_cpu_s"] for r in filters)
        p_total = sum(r["datatrove_cpu_s"] for r in filters)
        result["runs"][kind] = {
            "filters": filters,
            "total": {
                "kiln_cpu_s": k_total,
                "datatrove_cpu_s": p_total,
                "kiln_docs_per_cpu_s": len(texts) / k_total,
                "datatrove_docs_per_cpu_s": len(texts) / p_total,
                "speed_ratio": p_total / k_total,
            },
            "chain": compare_chain(texts, kiln, peer),
        }
    return result


# ------------------------------------------------------------------------------- printing
def report(result: dict) -> str:
    """The result as Markdown tables."""
    out = [
        f"Corpus: first {result['docs']} documents of {result['corpus']} "
        f"({result['chars'] / 1e6:.1f} M characters); Python {result['python']}, "
        f"datatrove {result['datatrove']}, nltk {result['nltk']}. "
        "Docs per CPU-second (time.process_time), "
        "× = kiln ÷ datatrove speed; agreement = same keep/remove decision.",
    ]
    for kind, run_ in result["runs"].items():
        out += [
            "",
            f"### datatrove word tokenizer: {kind}",
            "",
            "| filter | kiln docs/cpu-s | datatrove docs/cpu-s | × | agreement "
            "| removed kiln / datatrove | only kiln / only datatrove |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in run_["filters"]:
            out.append(
                f"| {r['filter']} | {r['kiln_docs_per_cpu_s']:,.0f} "
                f"| {r['datatrove_docs_per_cpu_s']:,.0f} | {r['speed_ratio']:.1f} "
                f"| {r['agreement']:.2%} | {r['kiln_removed']} / {r['datatrove_removed']} "
                f"| {r['only_kiln_removed']} / {r['only_datatrove_removed']} |"
            )
        t, ch = run_["total"], run_["chain"]
        out.append(
            f"| all four, each on every doc | {t['kiln_docs_per_cpu_s']:,.0f} "
            f"| {t['datatrove_docs_per_cpu_s']:,.0f} | {t['speed_ratio']:.1f} | | | |"
        )
        out.append(
            f"| chained (pipeline order) | {ch['kiln_docs_per_cpu_s']:,.0f} "
            f"| {ch['datatrove_docs_per_cpu_s']:,.0f} | {ch['speed_ratio']:.1f} "
            f"| {ch['agreement']:.2%} | kept {ch['kiln_kept']} / {ch['datatrove_kept']} | |"
        )
        for r in run_["filters"]:
            extra = ""
            if "c4_same_text_when_both_keep" in r:
                extra = f"; same output text when both keep: {r['c4_same_text_when_both_keep']:.2%}"
            out.append(
                f"- {r['filter']}: kiln reasons {r['kiln_reasons']}; "
                f"datatrove reasons {r['datatrove_reasons']}{extra}"
            )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: run and print."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=5000, help="documents to filter (default 5000)")
    ap.add_argument(
        "--peer-tokenizers",
        nargs="+",
        choices=PEER_TOKENIZERS,
        default=list(PEER_TOKENIZERS),
        help="datatrove word tokenizers to run with (default: both)",
    )
    add_noisy_flag(ap)
    args = ap.parse_args(argv)
    measured = begin("bench/data_filters.py", args.noisy)
    print(report(run(args.docs, args.peer_tokenizers)))
    print(measured.line())


if __name__ == "__main__":
    main()
