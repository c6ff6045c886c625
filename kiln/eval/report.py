"""The results of `kiln eval` as one JSON document and as a table for the terminal."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from kiln import __version__
from kiln.eval.lm import LossResult
from kiln.eval.multiple_choice import ACC_NORM_NAME, TaskResult, core_score

DEFINITIONS = {
    "acc": "fraction of items whose highest summed continuation log-prob is the gold choice",
    "acc_norm": "as acc, each choice's log-prob divided by its answer's UTF-8 bytes "
    "(the continuation without its leading space)",
    "lambada_acc": "every token of the final word is the model's greedy (argmax) prediction",
    "lambada_ppl": "exp(-mean over passages of the final word's log-prob)",
    "centred": "(primary - random_baseline) / (1 - random_baseline): 0 at chance, 1 perfect",
    "core": "mean of the centred scores of the tasks run (CORE-style aggregate)",
    "bits_per_byte": "total nats / (ln 2 * UTF-8 bytes of the text)",
}


def task_json(result: TaskResult, path: str) -> dict[str, Any]:
    """One task's entry in the results document."""
    return {
        "file": path,
        "kind": result.kind,
        "n": result.n_items,
        **{k: _finite(v) for k, v in result.metrics.items()},
        "primary": result.primary,
        "random_baseline": result.random_baseline,
        "centred": result.centred,
        "seconds": round(result.seconds, 3),
    }


def loss_json(result: LossResult) -> dict[str, Any]:
    """A loss / perplexity / bits-per-byte entry."""
    doc: dict[str, Any] = {
        "source": result.source,
        "loss": result.loss,
        "perplexity": result.perplexity,
        "tokens": result.n_tokens,
        "documents": result.n_documents,
        "stride": result.stride,
        "seconds": round(result.seconds, 3),
    }
    if result.n_bytes is not None:
        doc.update(bits_per_byte=result.bits_per_byte, bytes=result.n_bytes)
    return doc


def results_json(
    model: str,
    tokenizer: str,
    settings: dict[str, Any],
    tasks: list[tuple[TaskResult, str]],
    val: LossResult | None = None,
    bpb: LossResult | None = None,
    lm_eval: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole results document (see docs/eval.md for the fields)."""
    doc: dict[str, Any] = {
        "kiln_version": __version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": model,
        "tokenizer": tokenizer,
        "settings": settings,
        "definitions": DEFINITIONS,
        "tasks": {r.name: task_json(r, path) for r, path in tasks},
    }
    score = core_score([r for r, _ in tasks])
    if score is not None:
        doc["core"] = {"score": score, "tasks": [r.name for r, _ in tasks]}
    if val is not None:
        doc["val"] = loss_json(val)
    if bpb is not None:
        doc["bpb"] = loss_json(bpb)
    if lm_eval is not None:
        doc["lm_eval"] = lm_eval
    return doc


def format_table(
    tasks: list[TaskResult], val: LossResult | None = None, bpb: LossResult | None = None
) -> str:
    """A fixed-width table of the metrics, with the normalisation and centring spelled out."""
    lines: list[str] = []
    if tasks:
        header = (
            f"{'task':<14} {'n':>6} {'acc':>7} {'acc_norm':>8} {'ppl':>9} {'random':>7} "
            f"{'centred':>8}  primary"
        )
        lines += [header, "-" * len(header)]
        for r in tasks:
            m = r.metrics
            lines.append(
                f"{r.name:<14} {r.n_items:>6} {m['acc']:>7.4f} {_cell(m.get('acc_norm'), 8, 4)} "
                f"{_cell(m.get('ppl'), 9, 2)} {r.random_baseline:>7.4f} {r.centred:>8.4f}  "
                f"{r.primary}"
            )
        lines.append("-" * len(header))
        lines.append(
            f"CORE-style score (mean centred over {len(tasks)} tasks): {core_score(tasks):.4f}"
        )
        lines.append(
            f"acc: summed log-prob; {ACC_NORM_NAME}; centred = (primary - random) / (1 - random)"
        )
    for label, result in (("val", val), ("bpb", bpb)):
        if result is None:
            continue
        text = (
            f"{label}: loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f} "
            f"over {result.n_tokens:,} tokens"
        )
        if result.bits_per_byte is not None:
            text += f", {result.bits_per_byte:.4f} bits/byte over {result.n_bytes:,} bytes"
        lines.append(f"{text} ({result.source}, stride {result.stride})")
    return "\n".join(lines)


def _cell(value: float | None, width: int, digits: int) -> str:
    """A number right-aligned in `width`, or a dash when the metric does not apply."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _finite(value: float) -> float | None:
    """JSON has no NaN: an undefined value (a standard error of one item) becomes null."""
    return value if math.isfinite(value) else None
