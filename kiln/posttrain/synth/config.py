"""The TOML configs of `kiln data synth generate|rewrite` and `kiln data annotate`.

Every command names the model (`[model]`), how it samples (`[sampling]`), where the output goes
and its seed; relative paths are read relative to the TOML file. Everything but `output` shapes the
documents (the batch size sets the resumable parts), so it goes into the output's identity (resume refuses
another config without --force).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln import config as cfgio
from kiln.data.pipeline.config import SourceSpec
from kiln.errors import KilnError

PROMPT_FORMATS = ("auto", "plain", "chat")

# The TinyStories paper's instruction (Eldan & Li 2023, Sec. 2), with kiln's placeholders.
TINYSTORIES_TEMPLATE = (
    "Write a short story (3-5 paragraphs) which only uses very simple words that a 3 year old "
    'child would likely understand. The story should use the verb "{verb}", the noun "{noun}" '
    'and the adjective "{adjective}". {features}Remember to only use simple words!'
)

# WRAP's idea (Maini et al. 2024, "Rephrasing the Web", arXiv:2401.16380): the same content in
# a style the model learns well from; these are kiln's wordings of its styles.
STYLES = {
    "simple_story": "Rewrite the following text as a simple story that a young child would "
    "understand.\n\nText: {text}\n\nSimple story:",
    "qa": "Convert the following text into a set of questions and answers about what it says."
    "\n\nText: {text}\n\nQuestions and answers:",
    "wikipedia": "Rephrase the following text in high-quality English, as in sentences on "
    "Wikipedia.\n\nText: {text}\n\nRephrased:",
    "easy": "Rephrase the following text so that a small child could understand it."
    "\n\nText: {text}\n\nEasy version:",
}

# FineWeb-Edu's additive 0-5 educational-value rubric (Penedo et al. 2024, "The FineWeb
# Datasets", Sec. 3.3), shortened in kiln's words; the score is read from the next token.
EDU_RUBRIC = (
    "Below is an extract. Judge its educational value for teaching from primary school to "
    "grade school with an additive 5-point score:\n"
    "- Add 1 point if it gives some basic information relevant to educational topics.\n"
    "- Add another point if it addresses elements relevant to education in a coherent way.\n"
    "- Award a third point if it is suitable for educational use and introduces key concepts.\n"
    "- Grant a fourth point if it is highly relevant and beneficial for a grade-school level.\n"
    "- Bestow a fifth point if it is outstanding in its educational value.\n\n"
    "Extract: {text}\n\nEducational score (0 to 5):"
)


@dataclass(frozen=True)
class ModelSection:
    """The model that writes (or scores) and how it is run through the engine."""

    path: str = ""  # a kiln demo, run, checkpoint or HF folder (anything kiln.loading reads)
    tokenizer: str = ""  # default: the model's own
    device: str = "cpu"
    dtype: str = "fp32"
    batch_size: int = 32  # documents per engine batch, and per resumable part of the output
    prompt_format: str = "auto"  # auto: chat when the tokenizer has chat tokens, else plain
    batch_invariant: bool = True  # a seeded document is the same whatever its batch

    def __post_init__(self) -> None:
        if not self.path:
            raise KilnError("model.path: give the model folder (a kiln run, demo or HF folder)")
        if self.batch_size < 1:
            raise KilnError(f"model.batch_size = {self.batch_size}: expected >= 1")
        if self.prompt_format not in PROMPT_FORMATS:
            raise KilnError(
                f"model.prompt_format = {self.prompt_format!r}: expected one of {PROMPT_FORMATS}"
            )


@dataclass(frozen=True)
class SamplingSection:
    """Sampling settings of every document (each document has its own seed)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise KilnError(f"sampling.max_tokens = {self.max_tokens}: expected >= 1")
        if self.temperature < 0:
            raise KilnError(f"sampling.temperature = {self.temperature}: expected >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise KilnError(f"sampling.top_p = {self.top_p}: expected a fraction in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise KilnError(f"sampling.top_k = {self.top_k}: expected >= 1")
        if self.repetition_penalty <= 0:
            raise KilnError(
                f"sampling.repetition_penalty = {self.repetition_penalty}: expected > 0"
            )


@dataclass(frozen=True)
class GenerateConfig:
    """`kiln data synth generate`: TinyStories-style prompts from random words and features."""

    model: ModelSection
    output: str = ""  # the output folder; --out overrides
    documents: int = 100
    seed: int = 0
    template: str = TINYSTORIES_TEMPLATE  # {noun} {verb} {adjective} {features}
    words_file: str = ""  # nouns/verbs/adjectives/[features] TOML; default kiln/assets's
    max_features: int = 3  # each prompt asks for 0..max_features of the features
    keep_prompt: bool = False  # the document is prompt + completion (for a base model's start)
    sampling: SamplingSection = field(default_factory=SamplingSection)

    def __post_init__(self) -> None:
        if self.documents < 1:
            raise KilnError(f"documents = {self.documents}: expected >= 1")
        if self.max_features < 0:
            raise KilnError(f"max_features = {self.max_features}: expected >= 0")
        for name in ("{noun}", "{verb}", "{adjective}"):
            if name not in self.template:
                raise KilnError(f"template: expected the placeholder {name}")


@dataclass(frozen=True)
class RewriteConfig:
    """`kiln data synth rewrite`: each input document paraphrased into a named style (WRAP)."""

    model: ModelSection
    sources: tuple[SourceSpec, ...]
    output: str = ""
    style: str = "simple_story"  # a name in STYLES, or "custom" with `template`
    template: str = ""  # with style = "custom": the prompt, holding {text}
    max_input_tokens: int = 384  # the input is cut to this many tokens (of the model's tokenizer)
    max_documents: int = 1000  # the first ones in source order
    seed: int = 0
    sampling: SamplingSection = field(default_factory=SamplingSection)

    def __post_init__(self) -> None:
        if not self.sources:
            raise KilnError("sources: give at least one [[sources]] table of documents to rewrite")
        if self.style == "custom":
            if "{text}" not in self.template:
                raise KilnError("template: with style = 'custom', give a prompt holding {text}")
        elif self.style not in STYLES:
            choices = ", ".join([*STYLES, "custom"])
            raise KilnError(f"style = {self.style!r}: expected one of {choices}")
        elif self.template:
            raise KilnError("template: only with style = 'custom'")
        for name in ("max_input_tokens", "max_documents"):
            if getattr(self, name) < 1:
                raise KilnError(f"{name} = {getattr(self, name)}: expected >= 1")

    @property
    def prompt_template(self) -> str:
        """The prompt with {text} where the input goes."""
        return self.template if self.style == "custom" else STYLES[self.style]


@dataclass(frozen=True)
class AnnotateConfig:
    """`kiln data annotate`: a sample of documents scored 0-5 by a model with a rubric prompt."""

    model: ModelSection
    sources: tuple[SourceSpec, ...]
    output: str = ""
    rubric: str = EDU_RUBRIC  # the prompt, holding {text}; the score is the next token
    max_input_tokens: int = 384
    max_documents: int = 1000  # the sample's size at most
    sample_fraction: float = 1.0  # each document is in the sample by a seeded hash of its id
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sources:
            raise KilnError("sources: give at least one [[sources]] table of documents to score")
        if "{text}" not in self.rubric:
            raise KilnError("rubric: expected the placeholder {text}")
        if not 0.0 < self.sample_fraction <= 1.0:
            raise KilnError(f"sample_fraction = {self.sample_fraction}: expected (0, 1]")
        for name in ("max_input_tokens", "max_documents"):
            if getattr(self, name) < 1:
                raise KilnError(f"{name} = {getattr(self, name)}: expected >= 1")


def _resolve(path: str, base: Path) -> str:
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else os.path.normpath(base / expanded)


def load_synth_config(cls: type[Any], path: str | Path, overrides: tuple[str, ...] = ()) -> Any:
    """One of the configs above from TOML with `--set` overrides; relative paths resolved."""
    cfg = cfgio.load(cls, path, overrides)
    base = Path(path).resolve().parent
    model = replace(
        cfg.model,
        path=_resolve(cfg.model.path, base),
        tokenizer=_resolve(cfg.model.tokenizer, base) if cfg.model.tokenizer else "",
    )
    changes: dict[str, Any] = {"model": model}
    if cfg.output:
        changes["output"] = _resolve(cfg.output, base)
    if getattr(cfg, "words_file", ""):
        changes["words_file"] = _resolve(cfg.words_file, base)
    if hasattr(cfg, "sources"):
        changes["sources"] = tuple(
            replace(s, paths=tuple(_resolve(p, base) for p in s.paths)) for s in cfg.sources
        )
    return replace(cfg, **changes)


def config_digest(cfg: Any, model_sha256: str) -> str:
    """The identity of an output: the config (less where it goes) and the model's weights."""
    plain = cfgio.to_dict(replace(cfg, output=""))
    plain["model_sha256"] = model_sha256
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:16]
