"""Task metrics: multiple-choice accuracy (summed and per-byte log-prob), LAMBADA, centring.

A choice's score is the log-probability of its continuation given its context. `acc` picks the
choice with the highest summed log-prob; `acc_norm` the highest log-prob per UTF-8 byte of the
answer (the continuation less its leading space). lm-evaluation-harness's acc_norm divides by
characters of the same text, so the two agree on ASCII; bytes weigh every script alike.
The centred score rescales a task's primary metric so that random guessing is 0 and a perfect
score 1: (metric - baseline) / (1 - baseline).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from kiln.eval.scoring import Scorer, TextEncoder, encode_pair
from kiln.eval.tasks import LAST_WORD, Task

ACC_NORM_NAME = "acc_norm (log-prob per byte)"


@dataclass(frozen=True)
class TaskResult:
    """A task's metrics, and each choice's log-prob for inspection and parity checks."""

    name: str
    kind: str
    n_items: int
    metrics: dict[str, float]
    primary: str
    random_baseline: float
    seconds: float
    choice_logprobs: list[list[float]] = field(default_factory=list, repr=False)

    @property
    def centred(self) -> float:
        """The primary metric rescaled so that random guessing is 0 and perfect is 1."""
        return centred_score(self.metrics[self.primary], self.random_baseline)


def centred_score(metric: float, baseline: float) -> float:
    """(metric - baseline) / (1 - baseline): 0 at chance, 1 at perfect (negative below chance)."""
    return (metric - baseline) / (1.0 - baseline)


def core_score(results: list[TaskResult]) -> float | None:
    """The mean of the tasks' centred scores (a CORE-style aggregate); None without tasks."""
    if not results:
        return None
    return sum(r.centred for r in results) / len(results)


def evaluate_task(
    task: Task, scorer: Scorer, tok: TextEncoder, prefix_id: int | None
) -> TaskResult:
    """Score every choice of every item of `task` and compute its metrics."""
    started = time.perf_counter()
    flat = [choice for item in task.items for choice in item.choices]
    requests = [encode_pair(tok, c.context, c.continuation, prefix_id) for c in flat]
    scored = iter(scorer.score_requests(requests, desc=task.name))
    per_item = [[next(scored) for _ in item.choices] for item in task.items]
    logprobs = [[s.logprob for s in choices] for choices in per_item]
    if task.spec.kind == LAST_WORD:
        metrics = _last_word_metrics(logprobs, [choices[0].is_greedy for choices in per_item])
    else:
        metrics = _multiple_choice_metrics(task, logprobs)
    return TaskResult(
        name=task.name, kind=task.spec.kind, n_items=len(task.items), metrics=metrics,
        primary=task.spec.primary, random_baseline=task.random_baseline,
        seconds=time.perf_counter() - started, choice_logprobs=logprobs,
    )  # fmt: skip


def _multiple_choice_metrics(task: Task, logprobs: list[list[float]]) -> dict[str, float]:
    """acc (summed log-prob) and acc_norm (log-prob per continuation byte), with std errors."""
    hits, hits_norm = [], []
    for item, scores in zip(task.items, logprobs, strict=True):
        per_byte = [
            s / answer_bytes(c.continuation) for s, c in zip(scores, item.choices, strict=True)
        ]
        hits.append(float(_argmax(scores) == item.gold))
        hits_norm.append(float(_argmax(per_byte) == item.gold))
    acc, acc_norm = _mean(hits), _mean(hits_norm)
    return {
        "acc": acc,
        "acc_stderr": _stderr(acc, len(hits)),
        "acc_norm": acc_norm,
        "acc_norm_stderr": _stderr(acc_norm, len(hits)),
    }


def _last_word_metrics(logprobs: list[list[float]], greedy: list[bool]) -> dict[str, float]:
    """LAMBADA: acc = every token of the word is the argmax; ppl = exp(-mean word log-prob)."""
    acc = _mean([float(g) for g in greedy])
    mean_logprob = _mean([scores[0] for scores in logprobs])
    return {"acc": acc, "acc_stderr": _stderr(acc, len(greedy)), "ppl": math.exp(-mean_logprob)}


def answer_bytes(continuation: str) -> int:
    """UTF-8 bytes of the answer: the continuation without its word-boundary space (as lm-eval
    measures a choice's length for acc_norm, in characters)."""
    return max(1, len(continuation.removeprefix(" ").encode("utf-8")))


def _argmax(values: list[float]) -> int:
    """Index of the largest value (the first on ties, as numpy's argmax)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _stderr(p: float, n: int) -> float:
    """Standard error of a mean of n 0/1 outcomes (sample standard deviation, as lm-eval)."""
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")
