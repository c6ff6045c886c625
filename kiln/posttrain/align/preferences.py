"""Preference pairs from a chat model's own samples, judged by the task checks.

For each training prompt of a `kiln data chat` folder (never the held-out split), sample
`samples` replies, score each with the task's check (`kiln.posttrain.tasks.score`), and keep one
pair when at least one reply does everything asked (the chosen: the best-scoring such reply) and
at least one does not (the rejected: the worst-scoring). Each pair is a JSON line with the
prompt messages, both replies, their scores and the sampling settings, so a pair can be traced
back to how it was made.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kiln.chat import render, require_chat_template
from kiln.config import require
from kiln.errors import KilnError
from kiln.io import iter_json_lines, sha256_file, write_json_atomic
from kiln.model.generate import generate
from kiln.model.transformer import Transformer
from kiln.posttrain.align.dpo import TokenPair
from kiln.posttrain.output import check_output_folder, output_folder
from kiln.posttrain.tasks import check, score
from kiln.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class SamplingConfig:
    """How the replies of each prompt are drawn (recorded with every pair)."""

    samples: int = 4
    max_new_tokens: int = 192
    temperature: float = 1.0
    top_k: int | None = 50
    seed: int = 0
    greedy: bool = False  # one of the `samples` replies is the greedy one (on-policy pairs)

    def __post_init__(self) -> None:
        """Reject settings that cannot sample, naming the field."""
        require(self.samples >= 2, f"samples must be >= 2 to make a pair, got {self.samples}")
        require(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        require(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True)
class Reply:
    """A sampled reply's text, and whether the model ended it (False: cut at the length cap)."""

    text: str
    finished: bool = True


def sample_replies(
    model: Transformer,
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    cfg: SamplingConfig,
    seed: int,
) -> list[Reply]:
    """`cfg.samples` replies to a conversation's prompt, each up to the end token.

    None fit when the prompt fills the model's context: the list is empty.
    """
    template = require_chat_template(tokenizer, "sampling")
    prompt = render(messages, tokenizer, add_generation_prompt=True).ids
    room = model.cfg.block_size - len(prompt)
    if room < 1:
        return []  # no room to answer in the model's context: no pair
    n = min(cfg.max_new_tokens, room)
    sampled = cfg.samples - cfg.greedy
    replies = generate(
        model, [prompt] * sampled, n, temperature=cfg.temperature, top_k=cfg.top_k, seed=seed,
        stop_tokens=template.stop_ids,
    )  # fmt: skip
    if cfg.greedy:
        replies += generate(model, [prompt], n, temperature=0.0, stop_tokens=template.stop_ids)
    # A reply ends at the first control token (an end-of-text mid-reply, say): its text is what
    # the renderer can encode again, so every pair tokenizes under the refusing policy. A reply
    # that reached the length cap without ending is marked unfinished.
    special = set(tokenizer.special_tokens.values())
    out = []
    for r in replies:
        cut = next((i for i, t in enumerate(r) if t in special), len(r))
        finished = cut < len(r) or len(r) < min(cfg.max_new_tokens, room)
        out.append(Reply(tokenizer.decode(r[:cut]), finished))
    return out


def make_pair(record: Mapping[str, Any], replies: Sequence[Reply | str]) -> dict[str, Any] | None:
    """The pair of a record's replies (best passing vs worst failing), or None if there is none."""
    replies = [r if isinstance(r, Reply) else Reply(r) for r in replies]
    scored = [(score(record, r.text), check(record, r.text), r) for r in replies]
    passing = [s for s in scored if s[1]]
    failing = [s for s in scored if not s[1]]
    if not passing or not failing:
        return None
    chosen = max(passing, key=lambda s: s[0])
    rejected = min(failing, key=lambda s: s[0])
    return {
        "id": record.get("id"), "task": record.get("task"), "params": record.get("params"),
        "messages": list(record["messages"][:-1]), "chosen": chosen[2].text,
        "rejected": rejected[2].text, "chosen_finished": chosen[2].finished,
        "rejected_finished": rejected[2].finished,
        "chosen_score": chosen[0], "rejected_score": rejected[0],
        "scores": [s[0] for s in scored],
    }  # fmt: skip


ENGINE_PROMPTS = 16  # prompts sampled together on the engine, `samples` replies each


def build_pairs(
    model: Transformer,
    tokenizer: Tokenizer,
    records: Iterable[Mapping[str, Any]],
    cfg: SamplingConfig,
) -> Iterator[tuple[Mapping[str, Any], list[Reply], dict[str, Any] | None]]:
    """For each record (a prompt + reference reply): its replies and its pair (or None).

    Prompts are sampled ENGINE_PROMPTS at a time on the inference engine, record n's replies
    from seed cfg.seed + n (one stream per reply), so a run with the same settings repeats.
    """
    model.eval()
    chunk: list[Mapping[str, Any]] = []
    start = 0
    for record in [*records, None]:
        if record is not None:
            chunk.append(record)
        if chunk and (record is None or len(chunk) == ENGINE_PROMPTS):
            sampled = _sample_chunk(model, tokenizer, chunk, cfg, start)
            for record_k, replies in zip(chunk, sampled, strict=True):
                pair = make_pair(record_k, replies)
                if pair is not None:
                    pair["sampling"] = asdict(cfg)
                yield record_k, replies, pair
            start, chunk = start + len(chunk), []


def _sample_chunk(
    model: Transformer,
    tokenizer: Tokenizer,
    records: Sequence[Mapping[str, Any]],
    cfg: SamplingConfig,
    start: int,
) -> list[list[Reply]]:
    """The replies to each of some records (record k of the chunk is record start + k)."""
    from kiln.posttrain.align.rollout import engine_sample
    from kiln.serve.engine import SamplingParams

    template = require_chat_template(tokenizer, "sampling")
    prompts = [
        render(r["messages"][:-1], tokenizer, add_generation_prompt=True).ids for r in records
    ]
    fits = [k for k, p in enumerate(prompts) if len(p) < model.cfg.block_size]
    params = [
        SamplingParams(
            max_tokens=min(cfg.max_new_tokens, model.cfg.block_size - len(prompts[k])),
            temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed + start + k,
            n=cfg.samples - cfg.greedy, stop_token_ids=template.stop_ids, ignore_eos=True,
        )
        for k in fits
    ]  # fmt: skip
    asked = [prompts[k] for k in fits]
    if cfg.greedy:  # each prompt once more, at temperature 0: the reply evaluation would see
        greedy = [replace(p, n=1, temperature=0.0, top_k=None, seed=None) for p in params]
        asked, params = asked + asked, params + greedy
    sampled = engine_sample(model, asked, params, None) if fits else []
    if sampled and cfg.greedy:
        half = len(fits)
        sampled = [a + b for a, b in zip(sampled[:half], sampled[half:], strict=True)]
    if sampled is None:  # MLA or sinks: kiln.model.generate, one prompt at a time
        return [
            sample_replies(model, tokenizer, r["messages"][:-1], cfg, cfg.seed + start + k)
            for k, r in enumerate(records)
        ]
    # A reply ends at the first control token (an end-of-text mid-reply, say): its text is what
    # the renderer can encode again, so every pair tokenizes under the refusing policy. A reply
    # that reached the length cap without ending is marked unfinished.
    special = set(tokenizer.special_tokens.values())
    out: list[list[Reply]] = [[] for _ in records]
    for k, samples in zip(fits, sampled, strict=True):
        for ids, why in samples:
            cut = next((i for i, t in enumerate(ids) if t in special), len(ids))
            out[k].append(Reply(tokenizer.decode(ids[:cut]), why == "stop" or cut < len(ids)))
    return out


def read_pairs(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The pairs of a JSON-lines preference file; a bad line is one error naming it."""
    out = []
    for where, pair in iter_json_lines(path):
        for key in ("messages", "chosen", "rejected"):
            if not isinstance(pair, dict) or key not in pair:
                raise KilnError(f"{where}: expected a pair with '{key}'")
        for key in ("chosen", "rejected"):
            if not isinstance(pair[key], str):
                raise KilnError(f"{where}: '{key}' must be a string")
        out.append(pair)
    if not out:
        raise KilnError(f"{os.fspath(path)}: no preference pairs")
    return out


def tokenize_pair(pair: Mapping[str, Any], tokenizer: Tokenizer, where: str) -> TokenPair:
    """A pair as token ids: the rendered prompt and each reply with its end token.

    Replies go through the same renderer as SFT data (the refusing special-token policy
    included), so a reply is trained exactly as `kiln sft` would train it; a reply marked
    unfinished (cut at the length cap) gets no end token, so it never teaches stopping there.
    """
    prompt = render(pair["messages"], tokenizer, add_generation_prompt=True, where=where).ids

    def reply(side: str) -> list[int]:
        message = {"role": "assistant", "content": pair[side]}
        full = render([*pair["messages"], message], tokenizer, where=where).ids
        ids = full[len(prompt) :]  # the reply's text and its end token...
        return ids if pair.get(f"{side}_finished", True) else ids[:-1]  # ...if the model ended it

    return TokenPair(prompt, reply("chosen"), reply("rejected"))


MANIFEST = "manifest.json"
FORMAT = "kiln.preferences"


def write_preferences(
    model: str,
    chat: str,
    out: Path,
    cfg: SamplingConfig,
    max_prompts: int = 0,
    force: bool = False,
    progress: bool = True,
) -> str:
    """Sample and judge the train prompts of `chat`, write OUT (whole or not at all).

    Returns the summary: prompts and pairs per task.
    """
    from tqdm import tqdm

    from kiln.chat import iter_conversations
    from kiln.loading import load_model
    from kiln.posttrain.chat_data import read_manifest, split_file

    check_output_folder(out, force, MANIFEST)  # before any sampling
    loaded = load_model(model, dtype="fp32")
    if loaded.tokenizer is None:
        raise KilnError(f"{model}: no tokenizer found (sampling renders chats)")
    records = list(iter_conversations(split_file(chat, "train")))
    records = records[:max_prompts] if max_prompts else records
    prompts, kept, too_long = Counter[str](), Counter[str](), 0
    pairs = []
    bar = tqdm(total=len(records), desc="preferences", unit="prompt", disable=not progress)
    for record, replies, pair in build_pairs(loaded.model, loaded.tokenizer, records, cfg):
        prompts[record["task"]] += 1
        too_long += not replies
        if pair is not None:
            kept[record["task"]] += 1
            pairs.append(pair)
        bar.update(1)
        bar.set_postfix(pairs=len(pairs))
    bar.close()
    with output_folder(out, force, MANIFEST) as tmp:
        with (tmp / "pairs.jsonl").open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)
        manifest = {
            "format": FORMAT, "version": 1, "model": loaded.source,
            "chat_data_sha256": read_manifest(chat).get("sha256"), "sampling": asdict(cfg),
            "prompts": dict(sorted(prompts.items())), "pairs": dict(sorted(kept.items())),
            "prompts_too_long": too_long, "sha256": sha256_file(tmp / "pairs.jsonl"),
        }  # fmt: skip
        write_json_atomic(tmp / MANIFEST, manifest)
    rows = [f"  {t:<10} {kept[t]:>5} pairs of {n:>5} prompts" for t, n in sorted(prompts.items())]
    return "\n".join(
        [f"kiln posttrain preferences: {len(pairs):,} pairs in {out}/pairs.jsonl", *rows]
    )
