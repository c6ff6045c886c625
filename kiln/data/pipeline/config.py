"""PipelineConfig: what `kiln data run PIPELINE.toml` does, one dataclass per TOML table.

Relative paths in the TOML (source globs, eval files, the tokenizer) are read relative to the
TOML file's directory, so a config runs the same from any working directory.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from kiln import config as cfgio
from kiln.data.pipeline.decontaminate.ngram_overlap import DecontamConfig
from kiln.data.pipeline.dedup.exact import ExactDedupConfig
from kiln.data.pipeline.dedup.lines import LineDedupConfig
from kiln.data.pipeline.dedup.minhash import MinHashConfig
from kiln.data.pipeline.filter.bad_words import BadWordsConfig
from kiln.data.pipeline.filter.language import LanguageConfig
from kiln.data.pipeline.filter.normalise import NormaliseConfig
from kiln.data.pipeline.filter.pii import PIIConfig
from kiln.data.pipeline.filter.quality_c4 import C4Config
from kiln.data.pipeline.filter.quality_classifier import ClassifierConfig
from kiln.data.pipeline.filter.quality_fineweb import FineWebConfig
from kiln.data.pipeline.filter.quality_gopher import GopherQualityConfig, GopherRepetitionConfig
from kiln.data.pipeline.filter.quality_perplexity import PerplexityConfig
from kiln.data.pipeline.filter.url_blocklist import UrlBlocklistConfig
from kiln.data.pipeline.read.extract import ExtractConfig
from kiln.data.pipeline.read.readers import detect_format
from kiln.errors import KilnError
from kiln.tokenizer.special import EOT
from kiln.tokenizer.tokenizer import BYTES

FORMATS = ("auto", "txt", "jsonl", "parquet", "html", "warc")


@dataclass(frozen=True)
class SourceSpec:
    """One named source: files or globs, their format, and its place in the mixture."""

    name: str
    paths: tuple[str, ...]
    format: str = "auto"  # auto: from each file's extension
    text_field: str = "text"  # jsonl/parquet
    id_field: str = ""  # jsonl/parquet: a field holding a stable document id, if any
    separator: str = EOT  # txt: the line that separates documents
    share: float | None = None  # target share of the final training mixture, in tokens
    rate: float | None = None  # or: repeat each document this many times on average (0.5, 2)

    def __post_init__(self) -> None:
        where = f"sources[{self.name!r}]"
        if not self.name or any(c in self.name for c in ":/\\\n"):
            raise KilnError(f"{where}.name: give a name without ':', '/' or newlines")
        if not self.paths:
            raise KilnError(f"{where}.paths: give at least one file or glob")
        if self.format not in FORMATS:
            raise KilnError(f"{where}.format = {self.format!r}: expected one of {FORMATS}")
        if self.share is not None and self.rate is not None:
            raise KilnError(f"{where}: give share or rate, not both")
        if self.share is not None and not 0.0 < self.share <= 1.0:
            raise KilnError(f"{where}.share = {self.share}: expected a fraction in (0, 1]")
        if self.rate is not None and self.rate < 0.0:
            raise KilnError(f"{where}.rate = {self.rate}: expected >= 0")


@dataclass(frozen=True)
class QualityConfig:
    """The quality filters, run in this order."""

    gopher_quality: GopherQualityConfig = field(default_factory=GopherQualityConfig)
    gopher_repetition: GopherRepetitionConfig = field(default_factory=GopherRepetitionConfig)
    c4: C4Config = field(default_factory=C4Config)
    fineweb: FineWebConfig = field(default_factory=FineWebConfig)
    classifier: ClassifierConfig = field(default_factory=ClassifierConfig)  # model-based: last
    perplexity: PerplexityConfig = field(default_factory=PerplexityConfig)


@dataclass(frozen=True)
class DedupConfig:
    """Exact dedup on normalised text, then MinHash-LSH near dedup, then (after
    decontamination) line dedup over the surviving documents."""

    exact: ExactDedupConfig = field(default_factory=ExactDedupConfig)
    near: MinHashConfig = field(default_factory=MinHashConfig)
    lines: LineDedupConfig = field(default_factory=LineDedupConfig)


@dataclass(frozen=True)
class SplitConfig:
    """Validation documents are chosen by a seeded hash of their id, before any dedup."""

    val_fraction: float = 0.005

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise KilnError(f"split.val_fraction = {self.val_fraction}: expected [0, 1)")


@dataclass(frozen=True)
class TokenizeStageConfig:
    """The tokenizer and the shard layout of the output dataset."""

    tokenizer: str = ""  # a kiln or HF tokenizer.json, GPT-2 vocab directory, or "bytes" (BYTES)
    eot_token: str = EOT
    shard_tokens: int = 100_000_000

    def __post_init__(self) -> None:
        if self.shard_tokens < 1:
            raise KilnError(f"tokenize.shard_tokens = {self.shard_tokens}: expected >= 1")


@dataclass(frozen=True)
class PipelineConfig:
    """Everything that determines a pipeline's output (its hash guards resumption)."""

    sources: tuple[SourceSpec, ...]
    output: str = ""  # the dataset directory; `--out` overrides
    seed: int = 0
    docs_per_task: int = 5_000  # documents per unit of work (and of resumption)
    removed_samples: int = 5  # removed documents kept as examples per (stage, reason)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    url_blocklist: UrlBlocklistConfig = field(default_factory=UrlBlocklistConfig)
    normalise: NormaliseConfig = field(default_factory=NormaliseConfig)
    language: LanguageConfig = field(default_factory=LanguageConfig)
    bad_words: BadWordsConfig = field(default_factory=BadWordsConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    pii: PIIConfig = field(default_factory=PIIConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    decontaminate: DecontamConfig = field(default_factory=DecontamConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    tokenize: TokenizeStageConfig = field(default_factory=TokenizeStageConfig)

    def __post_init__(self) -> None:
        if not self.sources:
            raise KilnError("sources: give at least one [[sources]] table")
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise KilnError(f"sources: names must be unique, {dupes} repeat")
        shares = [s.share for s in self.sources if s.share is not None]
        if shares and len(shares) != len(self.sources):
            raise KilnError("sources: give share for every source or for none (use rate instead)")
        if shares and abs(sum(shares) - 1.0) > 1e-6:
            raise KilnError(f"sources: shares add up to {sum(shares):g}, expected 1")
        if self.docs_per_task < 1:
            raise KilnError(f"docs_per_task = {self.docs_per_task}: expected >= 1")
        if not self.tokenize.tokenizer:
            raise KilnError("tokenize.tokenizer: give the tokenizer file to encode with")

    def digest(self) -> str:
        """A hash of everything that shapes the output (not where it goes)."""
        plain = cfgio.to_dict(replace(self, output=""))
        return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:16]


def _resolve(path: str, base: Path) -> str:
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else os.path.normpath(base / expanded)


def load_pipeline_config(path: str | Path, overrides: tuple[str, ...] = ()) -> PipelineConfig:
    """Read a PipelineConfig from TOML (with `--set` overrides); resolve its relative paths."""
    cfg = cfgio.load(PipelineConfig, path, overrides)
    base = Path(path).resolve().parent
    sources = tuple(
        replace(s, paths=tuple(_resolve(p, base) for p in s.paths)) for s in cfg.sources
    )
    eval_files: list[str] = []
    for pattern in cfg.decontaminate.eval_files:
        hits = sorted(glob.glob(_resolve(pattern, base)))
        if not hits:
            raise KilnError(f"{path}: decontaminate.eval_files: {pattern} matches no file")
        eval_files.extend(hits)
    decontam = replace(cfg.decontaminate, eval_files=tuple(eval_files))
    tok = cfg.tokenize.tokenizer
    tokenize = replace(cfg.tokenize, tokenizer=tok if tok == BYTES else _resolve(tok, base))
    c4 = cfg.quality.c4
    if c4.bad_words_file:
        c4 = replace(c4, bad_words_file=_resolve(c4.bad_words_file, base))
    q = cfg.quality
    quality = replace(
        q,
        c4=c4,
        classifier=replace(q.classifier, model=_resolve(q.classifier.model, base))
        if q.classifier.model
        else q.classifier,
        perplexity=replace(q.perplexity, model=_resolve(q.perplexity.model, base))
        if q.perplexity.model
        else q.perplexity,
    )
    bad_words = cfg.bad_words
    if bad_words.words_file:
        bad_words = replace(bad_words, words_file=_resolve(bad_words.words_file, base))
    blocklist = cfg.url_blocklist
    if blocklist.file:
        blocklist = replace(blocklist, file=_resolve(blocklist.file, base))
    output = _resolve(cfg.output, base) if cfg.output else ""
    return replace(
        cfg,
        sources=sources,
        decontaminate=decontam,
        tokenize=tokenize,
        quality=quality,
        bad_words=bad_words,
        url_blocklist=blocklist,
        output=output,
    )


@dataclass(frozen=True)
class InputFile:
    """One input file of a source, with its resolved format."""

    source: str
    path: str
    format: str
    relpath: str  # the name used in document ids: stable across machines


def expand_sources(cfg: PipelineConfig) -> list[InputFile]:
    """Every input file, in a deterministic order: sources as listed, files sorted by path."""
    files: list[InputFile] = []
    for spec in cfg.sources:
        matched: list[str] = []
        for pattern in spec.paths:
            hits = sorted(glob.glob(pattern, recursive=True))
            if not hits:
                raise KilnError(f"sources[{spec.name!r}]: {pattern} matches no file")
            matched.extend(h for h in hits if os.path.isfile(h))
        seen: set[str] = set()
        unique = [p for p in matched if not (p in seen or seen.add(p))]
        if not unique:
            raise KilnError(f"sources[{spec.name!r}]: {', '.join(spec.paths)} match no file")
        common = os.path.commonpath(unique) if len(unique) > 1 else os.path.dirname(unique[0])
        for p in unique:
            fmt = detect_format(p) if spec.format == "auto" else spec.format
            files.append(InputFile(spec.name, p, fmt, os.path.relpath(p, common)))
    return files
