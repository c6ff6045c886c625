"""`kiln data synth generate|rewrite` and `kiln data annotate`: records made by a model through
the engine, each with its provenance, into a resumable output folder (see output.py).

generate: the TinyStories method (Eldan & Li 2023, arXiv:2305.07759): every prompt asks for a
story that uses a random noun, verb and adjective and a random subset of story features, so the
stories spread over the vocabulary instead of repeating the model's favourite one.
rewrite: WRAP (Maini et al. 2024, arXiv:2401.16380): each input document paraphrased into a
style ("as a simple story", "as questions and answers").
annotate: FineWeb-Edu (Penedo et al. 2024): a sample of documents scored 0-5 with a rubric
prompt, the score being the expectation over the digit logits of the model's next token; the
scores train the quality classifier (`kiln data classifier train` with `[[annotations]]`).
"""

from __future__ import annotations

import glob
import os
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln import config as cfgio
from kiln.data.pipeline.config import SourceSpec
from kiln.data.pipeline.read.readers import ReadIssues, detect_format, iter_records
from kiln.data.pipeline.records import hash64, unit_interval
from kiln.errors import KilnError
from kiln.posttrain.synth import output
from kiln.posttrain.synth.config import (
    AnnotateConfig,
    GenerateConfig,
    RewriteConfig,
    config_digest,
    load_synth_config,
)
from kiln.posttrain.synth.model_runner import SynthModel, load_synth_model

WORDS_ASSET = Path(__file__).resolve().parents[2] / "assets" / "synth_words.toml"


@dataclass(frozen=True)
class Words:
    """The vocabulary prompts draw from: nouns, verbs, adjectives, and named story features."""

    nouns: tuple[str, ...]
    verbs: tuple[str, ...]
    adjectives: tuple[str, ...]
    features: dict[str, str]


def load_words(path: str) -> Words:
    """The word lists of a TOML file (kiln/assets/synth_words.toml by default)."""
    where = path or str(WORDS_ASSET)
    try:
        data = tomllib.loads(Path(where).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KilnError(f"words_file = {where!r}: no such file") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise KilnError(f"words_file = {where!r}: not a readable TOML file ({exc})") from None
    lists = {}
    for name in ("nouns", "verbs", "adjectives"):
        value = data.get(name)
        if not isinstance(value, list) or not value or not all(isinstance(w, str) for w in value):
            raise KilnError(f"{where}: {name}: expected a non-empty list of words")
        lists[name] = tuple(value)
    features = data.get("features", {})
    if not isinstance(features, dict) or not all(isinstance(v, str) for v in features.values()):
        raise KilnError(f'{where}: [features]: expected name = "instruction" pairs')
    return Words(lists["nouns"], lists["verbs"], lists["adjectives"], dict(features))


def story_prompt(cfg: GenerateConfig, words: Words, index: int) -> tuple[str, dict[str, Any]]:
    """The prompt of story `index` and what was drawn for it (a pure function of seed, index)."""
    rng = np.random.default_rng([cfg.seed, index])
    drawn: dict[str, Any] = {
        "noun": words.nouns[int(rng.integers(len(words.nouns)))],
        "verb": words.verbs[int(rng.integers(len(words.verbs)))],
        "adjective": words.adjectives[int(rng.integers(len(words.adjectives)))],
    }
    names = list(words.features)
    k = int(rng.integers(0, min(cfg.max_features, len(names)) + 1))
    picked = sorted(int(i) for i in rng.choice(len(names), size=k, replace=False)) if k else []
    drawn["features"] = [names[i] for i in picked]
    text = ", ".join(words.features[names[i]] for i in picked)
    features = f"The story should have the following features: {text}. " if text else ""
    try:
        prompt = cfg.template.format_map({**drawn, "features": features})
    except (KeyError, ValueError, IndexError) as exc:
        raise KilnError(f"template: cannot fill it in ({exc!r}); double literal braces") from None
    return prompt, drawn


def document_seed(seed: int, kind: str, index: int) -> int:
    """The sampling seed of record `index` (stable across runs, processes and machines)."""
    return hash64(seed, kind, index) % (1 << 31)


def _units(items: list[Any], size: int) -> Iterator[tuple[int, list[Any]]]:
    for unit, start in enumerate(range(0, len(items), size)):
        yield unit, items[start : start + size]


def _run(
    folder: Path, items: list[Any], size: int, make: Any, summary: dict[str, Any], progress: bool
) -> dict[str, Any]:
    """Make the missing parts, join them; the manifest, with how many parts this run made."""
    made, found = output.run_units(folder, _units(items, size), make, len(items), progress)
    manifest = output.finish(folder, -(-len(items) // size), summary)
    return {**manifest, "parts_made": made, "parts_found": found}


def _sampling(cfg: Any) -> dict[str, Any]:
    return cfgio.to_dict(cfg.sampling)


def _prepare(cfg: Any, command: str, where: str, force: bool) -> tuple[SynthModel, Path, str]:
    """(the model, the output folder, the digest; "" when the output is finished already)."""
    if not cfg.output:
        raise KilnError(f"{where}: output: give the output folder (or --out)")
    model = load_synth_model(cfg.model, where)
    digest = config_digest(cfg, model.provenance["model_sha256"])
    identity = {
        "command": command,
        "digest": digest,
        "config": cfgio.to_dict(cfg),
        "model": model.provenance,
    }
    finished = output.open_output(Path(cfg.output), identity, force)
    return model, Path(cfg.output), "" if finished else digest


def generate(
    path: str | Path,
    overrides: tuple[str, ...] = (),
    out: str = "",
    force: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Run `kiln data synth generate CONFIG.toml`; the output's manifest."""
    cfg: GenerateConfig = load_synth_config(GenerateConfig, path, overrides)
    if out:
        cfg = _with_output(cfg, out)
    words = load_words(cfg.words_file)
    model, folder, digest = _prepare(cfg, "generate", str(path), force)
    if not digest:
        return output.read_manifest(folder)
    sampling = _sampling(cfg)

    def make(indices: list[int]) -> list[dict[str, Any]]:
        drawn = [story_prompt(cfg, words, i) for i in indices]
        seeds = [document_seed(cfg.seed, "generate", i) for i in indices]
        texts = model.complete([p for p, _ in drawn], seeds, cfg.sampling)
        records = []
        for i, (prompt, choice), seed, (text, finish) in zip(
            indices, drawn, seeds, texts, strict=True
        ):
            body = prompt + text if cfg.keep_prompt else text.strip()
            records.append(
                {
                    "id": f"gen-{digest[:8]}-{i:07d}",
                    "text": body,
                    "provenance": {
                        "method": "generate",
                        "recipe": "TinyStories",
                        **model.provenance,
                        "prompt": prompt,
                        "seed": seed,
                        "sampling": sampling,
                        "drawn": choice,
                        "finish_reason": finish,
                    },
                }
            )
        return records

    summary = {"model": model.provenance, "sampling": sampling}
    return _run(folder, list(range(cfg.documents)), cfg.model.batch_size, make, summary, progress)


def rewrite(
    path: str | Path,
    overrides: tuple[str, ...] = (),
    out: str = "",
    force: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Run `kiln data synth rewrite CONFIG.toml`; the output's manifest."""
    cfg: RewriteConfig = load_synth_config(RewriteConfig, path, overrides)
    if out:
        cfg = _with_output(cfg, out)
    inputs = read_inputs(cfg.sources, cfg.max_documents)
    model, folder, digest = _prepare(cfg, "rewrite", str(path), force)
    if not digest:
        return output.read_manifest(folder)
    sampling = _sampling(cfg)

    def make(items: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
        prompts = [
            cfg.prompt_template.replace("{text}", model.cut(d["text"], cfg.max_input_tokens))
            for _, d in items
        ]
        seeds = [document_seed(cfg.seed, "rewrite", i) for i, _ in items]
        texts = model.complete(prompts, seeds, cfg.sampling)
        return [
            {
                "id": f"wrap-{digest[:8]}-{i:07d}",
                "text": text.strip(),
                "provenance": {
                    "method": "rewrite",
                    "recipe": "WRAP",
                    "style": cfg.style,
                    **model.provenance,
                    "prompt": prompt,
                    "seed": seed,
                    "sampling": sampling,
                    "input": _input_ref(d),
                    "finish_reason": finish,
                },
            }
            for (i, d), prompt, seed, (text, finish) in zip(
                items, prompts, seeds, texts, strict=True
            )
        ]

    items = list(enumerate(inputs))
    summary = {
        "model": model.provenance,
        "sampling": sampling,
        "style": cfg.style,
        "inputs": len(inputs),
    }
    return _run(folder, items, cfg.model.batch_size, make, summary, progress)


def annotate(
    path: str | Path,
    overrides: tuple[str, ...] = (),
    out: str = "",
    force: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Run `kiln data annotate CONFIG.toml`; the output's manifest (with the score histogram)."""
    cfg: AnnotateConfig = load_synth_config(AnnotateConfig, path, overrides)
    if out:
        cfg = _with_output(cfg, out)
    inputs = [
        d
        for d in read_inputs(cfg.sources, None)
        if unit_interval(cfg.seed, "annotate", d["id"]) < cfg.sample_fraction
    ][: cfg.max_documents]
    model, folder, digest = _prepare(cfg, "annotate", str(path), force)
    if not digest:
        return output.read_manifest(folder)

    def make(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        prompts = [
            cfg.rubric.replace("{text}", model.cut(d["text"], cfg.max_input_tokens)) for d in items
        ]
        scores = model.digit_scores(prompts)
        return [
            {
                "id": d["id"],
                "text": d["text"],
                **s,
                "provenance": {
                    "method": "annotate",
                    "recipe": "FineWeb-Edu",
                    **model.provenance,
                    "rubric": cfg.rubric,
                    "input": _input_ref(d),
                },
            }
            for d, s in zip(items, scores, strict=True)
        ]

    summary = {"model": model.provenance, "inputs": len(inputs)}
    manifest = _run(folder, inputs, cfg.model.batch_size, make, summary, progress)
    return _with_score_summary(folder, manifest)


def _with_score_summary(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    import json

    scores, digits = [], [0] * 6
    with open(folder / output.DOCUMENTS, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            scores.append(record["score"])
            digits[record["digit"]] += 1
    manifest["scores"] = {
        "mean": float(np.mean(scores)) if scores else float("nan"),
        "std": float(np.std(scores)) if scores else float("nan"),
        "argmax_digits": digits,
    }
    from kiln.io import write_json_atomic

    kept = {k: v for k, v in manifest.items() if k not in ("path", "parts_made", "parts_found")}
    write_json_atomic(folder / output.MANIFEST, kept)
    return manifest


def _with_output(cfg: Any, out: str) -> Any:
    from dataclasses import replace

    return replace(cfg, output=os.path.abspath(out))


def _input_ref(doc: dict[str, Any]) -> dict[str, Any]:
    import hashlib

    sha = hashlib.sha256(doc["text"].encode("utf-8")).hexdigest()
    return {
        "id": doc["id"],
        "source": doc["source"],
        "file": doc["file"],
        "ordinal": doc["ordinal"],
        "sha256": sha,
    }


def read_inputs(specs: tuple[SourceSpec, ...], limit: int | None) -> list[dict[str, Any]]:
    """The documents of the sources in order (files sorted per pattern), the first `limit`."""
    docs: list[dict[str, Any]] = []
    for spec in specs:
        for pattern in spec.paths:
            hits = sorted(h for h in glob.glob(pattern) if os.path.isfile(h))
            if not hits:
                raise KilnError(f"sources[{spec.name!r}]: {pattern} matches no file")
            for file in hits:
                fmt = detect_format(file) if spec.format == "auto" else spec.format
                records = iter_records(
                    file,
                    fmt,
                    text_field=spec.text_field,
                    id_field=spec.id_field or None,
                    separator=spec.separator,
                    issues=ReadIssues(),
                )
                for ordinal, doc in enumerate(records):
                    if doc is None:
                        continue
                    name = os.path.basename(file)
                    docs.append(
                        {
                            "id": doc.id or f"{spec.name}:{name}:{ordinal}",
                            "source": spec.name,
                            "file": file,
                            "ordinal": ordinal,
                            "text": doc.text,
                        }
                    )
                    if limit is not None and len(docs) >= limit:
                        return docs
    if not docs:
        raise KilnError(f"sources: {', '.join(s.name for s in specs)} hold no documents")
    return docs
