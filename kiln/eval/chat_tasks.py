"""`kiln eval MODEL --chat-tasks [DATA]`: instruction following on the held-out chat prompts.

Each held-out conversation (`kiln data chat`'s heldout split; without DATA, the same split built
in memory with the default settings) is rendered up to its final reply with the generation
prompt, the model writes a reply (greedy by default, on kiln.serve's engine with continuous
batching; each reply may use the context its prompt leaves, up to max_tokens), and the task's own check
(`kiln.posttrain.tasks.check`) says whether it succeeded. Per task: the success rate with a
95% Wilson interval (sound at 0 or n successes and for small n), and the mean graded score.
A prompt that leaves the model fewer than MIN_REPLY_TOKENS of context for its reply is not
scored and is counted as skipped. `stopped` counts the replies that ended with the chat format's
`<|end|>` (or end-of-text) before their token cap: a chat model that has learned to stop. A reply
cut at its cap is not a success whatever its check says: an unfinished story is not what was
asked (and a cut story passed "about K sentences" by stopping near K).
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from kiln.chat import render, require_chat_template
from kiln.errors import KilnError
from kiln.loading import LoadedModel
from kiln.posttrain.replies import ReplyGenerator, ReplySettings, reply_stop_ids
from kiln.posttrain.tasks import TASKS, check, score

MIN_REPLY_TOKENS = 32
Z_95 = 1.959963984540054  # the standard normal's 97.5th percentile


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a success rate (95% by default); (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class ChatTaskResult:
    """One task's outcome on the held-out prompts."""

    task: str
    n: int = 0  # prompts scored
    successes: int = 0
    score_sum: float = 0.0
    skipped: int = 0  # prompts too long for the model's context
    stopped: int = 0  # replies that ended on a stop token before the cap
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Fraction of scored prompts whose reply passed the check."""
        return self.successes / self.n if self.n else 0.0

    @property
    def stop_rate(self) -> float:
        """Fraction of scored replies that ended on a stop token before the cap."""
        return self.stopped / self.n if self.n else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        """95% Wilson interval of the rate."""
        return wilson_interval(self.successes, self.n)

    @property
    def mean_score(self) -> float:
        """Mean graded score (the fraction of each ask that the reply did)."""
        return self.score_sum / self.n if self.n else 0.0

    def to_json(self) -> dict[str, Any]:
        """The task's entry in the results document."""
        low, high = self.interval
        return {
            "n": self.n, "successes": self.successes, "success_rate": self.rate,
            "ci95": [low, high], "mean_score": self.mean_score, "skipped": self.skipped,
            "stopped": self.stopped, "stop_rate": self.stop_rate, "samples": self.samples,
        }  # fmt: skip


def heldout_records(
    data: str | os.PathLike[str] | None, limit: int | None
) -> tuple[list[dict[str, Any]], str]:
    """The held-out conversations (at most `limit` per task) and a description of their source."""
    from kiln.chat import iter_conversations
    from kiln.posttrain.chat_data import ChatDataConfig, build, split_file

    if data is None:
        # The held-out split does not depend on max_stories: build as little train as can be.
        records = [e.to_json() for e in build(ChatDataConfig(max_stories=1)).splits["heldout"]]
        source = "the default held-out split (kiln data chat's defaults, built in memory)"
    else:
        path = split_file(data, "heldout")
        records = list(iter_conversations(path))
        source = str(path)
    if limit is not None:
        kept: dict[str, int] = defaultdict(int)
        first = []
        for record in records:
            kept[record["task"]] += 1
            if kept[record["task"]] <= limit:
                first.append(record)
        records = first
    unknown = sorted({r.get("task") for r in records} - set(TASKS), key=str)
    if unknown:
        raise KilnError(f"{source}: unknown task(s) {unknown}; expected {', '.join(TASKS)}")
    return records, source


def _batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def evaluate_chat_tasks(
    loaded: LoadedModel,
    records: list[dict[str, Any]],
    settings: ReplySettings,
    batch_size: int = 16,
    samples_per_task: int = 3,
    progress: bool = False,
) -> list[ChatTaskResult]:
    """Generate a reply to each record's prompt and check it; one result per task (TASKS order)."""
    tok = loaded.tokenizer
    assert tok is not None
    template = require_chat_template(tok, "kiln eval --chat-tasks")
    stops = reply_stop_ids(loaded, template.stop_ids)
    block = loaded.model.cfg.block_size
    results = {t: ChatTaskResult(t) for t in TASKS if any(r["task"] == t for r in records)}
    jobs = []
    for record in records:
        ids = render(
            record["messages"][:-1], tok, add_generation_prompt=True, where=record.get("id", "?")
        ).ids
        if block - len(ids) < MIN_REPLY_TOKENS:
            results[record["task"]].skipped += 1
        else:
            jobs.append((record, ids))
    generator = ReplyGenerator(loaded, stops, max_batch=batch_size)
    bar = _bar(len(jobs), progress)
    for batch in _batches(jobs, 4 * batch_size):  # the engine batches; chunks show progress
        budgets = [
            replace(settings, max_tokens=min(settings.max_tokens, block - len(ids)))
            for _, ids in batch
        ]
        outputs = generator.generate_ended([ids for _, ids in batch], budgets)
        for (record, _), (reply_ids, ended) in zip(batch, outputs, strict=True):
            reply = tok.decode([i for i in reply_ids if i < tok.n_vocab])
            result = results[record["task"]]
            passed = ended and check(record, reply)
            result.n += 1
            result.successes += passed
            result.stopped += ended
            result.score_sum += score(record, reply)
            if len(result.samples) < samples_per_task:
                prompt = record["messages"][-2]["content"]
                result.samples.append(
                    {"id": record.get("id"), "prompt": prompt, "reply": reply, "passed": passed}
                )
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    return list(results.values())


def _bar(total: int, progress: bool) -> Any:
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="chat tasks", unit="prompt", dynamic_ncols=True)


def chat_tasks_json(
    results: list[ChatTaskResult], source: str, settings: ReplySettings, seconds: float
) -> dict[str, Any]:
    """The `chat_tasks` entry of `kiln eval`'s results document."""
    total = ChatTaskResult("all")
    for r in results:
        total.n, total.successes = total.n + r.n, total.successes + r.successes
        total.score_sum, total.skipped = total.score_sum + r.score_sum, total.skipped + r.skipped
        total.stopped += r.stopped
    return {
        "source": source,
        "settings": {
            "temperature": settings.temperature,
            "max_tokens": settings.max_tokens,
            "seed": settings.seed,
        },
        "tasks": {r.task: r.to_json() for r in results},
        "all": {k: v for k, v in total.to_json().items() if k != "samples"},
        "seconds": round(seconds, 3),
        "definition": "success: the task's check (kiln.posttrain.tasks) passes on the reply; "
        "ci95: Wilson score interval; mean_score: the graded score in [0, 1]; stop_rate: the "
        "share of replies that ended with <|end|> before the token cap",
    }


def format_chat_table(doc: dict[str, Any]) -> str:
    """The chat-task rows of `kiln eval`'s table."""
    header = (
        f"{'chat task':<12} {'n':>5} {'success':>8} {'95% CI':>16} {'score':>6} {'stopped':>8} "
        f"{'skipped':>8}"
    )
    lines = [header, "-" * len(header)]
    rows = [*doc["tasks"].items(), ("all", doc["all"])]
    for name, r in rows:
        low, high = r["ci95"]
        lines.append(
            f"{name:<12} {r['n']:>5} {r['success_rate']:>8.3f} {f'[{low:.3f}, {high:.3f}]':>16} "
            f"{r['mean_score']:>6.3f} {r.get('stop_rate', 0.0):>8.3f} {r['skipped']:>8}"
        )
    lines.append(f"(held-out prompts: {doc['source']}; success = the task's check passes)")
    return "\n".join(lines)


def evaluate_chat_records(
    loaded: LoadedModel,
    held: tuple[list[dict[str, Any]], str],
    settings: ReplySettings,
    batch_size: int,
    progress: bool,
) -> dict[str, Any]:
    """Evaluate the `heldout_records` output and return the results document's entry."""
    started = time.perf_counter()
    records, source = held
    results = evaluate_chat_tasks(loaded, records, settings, batch_size, progress=progress)
    return chat_tasks_json(results, source, settings, time.perf_counter() - started)
