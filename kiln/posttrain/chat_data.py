"""`kiln data chat OUT`: instruction conversations made from TinyStories, offline and seeded.

Each story becomes one example of one task (`kiln.posttrain.tasks`): of the tasks the story
fits, the one its split has least of so far, so the tasks stay balanced. With `tasks_per_story`
K > 1 a train story gives up to K examples, of K different tasks chosen the same way (the
embedded corpus has ~7,000 stories: one task each leaves ~1,000 conversations per task); the
held-out split keeps one per story, so its prompts stay independent. Stories are shuffled
with the seed; the first `heldout` go to the held-out split (for `kiln eval --chat-tasks`), the
rest (at most `max_stories`) to train, so the splits never share a story. Exact duplicate
stories and stories holding special-token text are dropped and counted.

OUT holds `train.jsonl`, `heldout.jsonl` (one `Example.to_json()` per line) and `manifest.json`
(sources with their sha256, counts per split and task, each file's sha256 and one over both).
The same sources and seed give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.data.documents import iter_documents
from kiln.errors import KilnError
from kiln.io import sha256_file, write_json_atomic
from kiln.posttrain.output import check_output_folder, output_folder
from kiln.posttrain.tasks import TASKS, Example, common_words, make_example
from kiln.tokenizer.special import EOT

MANIFEST = "manifest.json"
FORMAT = "kiln.chat_data"
SPLITS = ("train", "heldout")
DEFAULT_SOURCE = Path(__file__).resolve().parents[1] / "assets" / "tinystories_train.txt.gz"


@dataclass(frozen=True)
class ChatDataConfig:
    """What `kiln data chat` builds: from which stories, how many, which tasks, which seed."""

    sources: tuple[str, ...] = (str(DEFAULT_SOURCE),)
    seed: int = 0
    heldout: int = 250  # stories in the held-out split
    max_stories: int | None = None  # stories in the train split (default: all the rest)
    tasks: tuple[str, ...] = tuple(TASKS)
    tasks_per_story: int = 1  # train examples per story, of different tasks (held-out: always 1)

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise KilnError(f"tasks {unknown or '(none)'}: expected some of {', '.join(TASKS)}")
        if self.heldout < 1:
            raise KilnError(f"heldout must be >= 1 story, got {self.heldout}")
        if self.tasks_per_story < 1:
            raise KilnError(f"tasks_per_story must be >= 1, got {self.tasks_per_story}")
        if self.max_stories is not None and self.max_stories < 1:
            raise KilnError(f"max_stories must be >= 1, got {self.max_stories}")


@dataclass
class Built:
    """The examples of each split and what was dropped on the way."""

    splits: dict[str, list[Example]]
    sources: list[dict[str, Any]]
    dropped: dict[str, int] = field(default_factory=dict)


def source_files(sources: Sequence[str]) -> list[Path]:
    """The story files a source list names (a folder: its train*.txt[.gz] files)."""
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            found = sorted(
                p for p in path.iterdir() if p.name.startswith("train") and ".txt" in p.name
            )
            if not found:
                raise KilnError(f"{path}: no train*.txt or train*.txt.gz story file in this folder")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise KilnError(f"{path}: no such story file or folder")
    return files


def _read_stories(files: list[Path]) -> tuple[list[str], list[dict[str, Any]], Counter[str]]:
    """Every distinct story of the files, in order; per-file records; what was dropped."""
    stories: list[str] = []
    seen: set[str] = set()
    records, dropped = [], Counter[str]()
    for path in files:
        count = 0
        for story in iter_documents(str(path), EOT):
            if "<|" in story and "|>" in story:
                dropped["special_token_text"] += 1  # the refusing policy would reject it
                continue
            digest = hashlib.sha256(story.encode("utf-8")).hexdigest()
            if digest in seen:
                dropped["duplicates"] += 1
                continue
            seen.add(digest)
            stories.append(story)
            count += 1
        records.append({"path": str(path), "sha256": sha256_file(path), "stories": count})
    return stories, records, dropped


def _assign(
    stories: list[str],
    order: list[int],
    tasks: tuple[str, ...],
    rng: random.Random,
    common: frozenset[str],
    per_story: int = 1,
) -> tuple[list[Example], int]:
    """Up to `per_story` examples per story in `order`, of different tasks, the least-made
    fitting task first; (examples, stories that fit no task)."""
    made: Counter[str] = Counter()
    out, unfit = [], 0
    for index in order:
        ranked = sorted(tasks, key=lambda t: (made[t], tasks.index(t)))
        taken = 0
        for task in ranked:
            example = make_example(task, stories[index], index, rng, common)
            if example is not None:
                out.append(example)
                made[task] += 1
                taken += 1
                if taken == per_story:
                    break
        unfit += taken == 0
    return out, unfit


def build(config: ChatDataConfig) -> Built:
    """The held-out and train examples for `config` (deterministic given the sources and seed)."""
    stories, records, dropped = _read_stories(source_files(config.sources))
    if len(stories) <= config.heldout:
        raise KilnError(
            f"{len(stories)} usable stories in {', '.join(config.sources)}: need more than the "
            f"{config.heldout} held out (lower --heldout)"
        )
    order = list(range(len(stories)))
    random.Random(config.seed).shuffle(order)
    held, rest = order[: config.heldout], order[config.heldout :]
    if config.max_stories is not None:
        rest = rest[: config.max_stories]
    common = common_words(stories)
    splits = {}
    for name, indices in (("heldout", held), ("train", rest)):
        rng = random.Random(f"{config.seed}:{name}")
        per_story = config.tasks_per_story if name == "train" else 1
        splits[name], unfit = _assign(stories, indices, config.tasks, rng, common, per_story)
        dropped[f"{name}_fits_no_task"] = unfit
    return Built({s: splits[s] for s in SPLITS}, records, dict(sorted(dropped.items())))


def _jsonl_lines(examples: list[Example]) -> Iterator[str]:
    for example in examples:
        yield json.dumps(example.to_json(), ensure_ascii=False, sort_keys=True) + "\n"


def write_chat_data(
    config: ChatDataConfig, out: str | os.PathLike[str], force: bool = False
) -> dict[str, Any]:
    """Build the data and write OUT (whole or not at all); returns the manifest."""
    out = Path(out)
    check_output_folder(out, force, MANIFEST)  # before reading thousands of stories
    built = build(config)
    with output_folder(out, force, MANIFEST) as tmp:
        splits = {}
        for name, examples in built.splits.items():
            file = tmp / f"{name}.jsonl"
            with open(file, "w", encoding="utf-8") as handle:
                handle.writelines(_jsonl_lines(examples))
            splits[name] = {
                "file": file.name,
                "examples": len(examples),
                "stories": len({e.story for e in examples}),
                "tasks": dict(sorted(Counter(e.task for e in examples).items())),
                "sha256": sha256_file(file),
            }
        overall = hashlib.sha256("".join(splits[s]["sha256"] for s in SPLITS).encode()).hexdigest()
        manifest = {
            "format": FORMAT, "version": 1, "sha256": overall, "splits": splits,
            "sources": built.sources, "dropped": built.dropped,
            "config": {**asdict(config), "sources": list(config.sources), "tasks": list(config.tasks)},
            "kiln_version": __version__,
        }  # fmt: skip
        write_json_atomic(tmp / MANIFEST, manifest)
    return manifest


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a `kiln data chat` folder (checked for its format)."""
    path = Path(folder) / MANIFEST
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KilnError(f"{path}: not a readable chat data manifest ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise KilnError(f"{path}: not a `kiln data chat` manifest (format {FORMAT!r} expected)")
    return doc


def split_file(folder: str | os.PathLike[str], split: str) -> Path:
    """The JSON-lines file of one split of a chat data folder, its sha256 checked."""
    doc = read_manifest(folder)
    entry = doc["splits"].get(split)
    if entry is None:
        raise KilnError(f"{folder}: no split {split!r} (has {', '.join(doc['splits'])})")
    path = Path(folder) / entry["file"]
    if not path.is_file() or sha256_file(path) != entry["sha256"]:
        raise KilnError(f"{path}: missing or changed since {MANIFEST} was written (sha256 differs)")
    return path


def format_summary(manifest: dict[str, Any], out: str | os.PathLike[str]) -> str:
    """The CLI's report: examples per split and task, what was dropped, where it went."""
    lines = []
    for name, entry in manifest["splits"].items():
        tasks = ", ".join(f"{t} {n}" for t, n in entry["tasks"].items())
        lines.append(f"{name:<8} {entry['examples']:>6,} conversations ({tasks})")
    dropped = ", ".join(f"{k} {v}" for k, v in manifest["dropped"].items() if v) or "nothing"
    lines.append(f"dropped: {dropped}")
    lines.append(f"wrote {out} (sha256 {manifest['sha256'][:12]}…)")
    return "\n".join(lines)
