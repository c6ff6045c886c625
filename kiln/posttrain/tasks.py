"""Instruction tasks made from a story, each with the program that checks a reply.

Every task turns one TinyStories story into a conversation (the prompt, and the story-derived
reply a model is fine-tuned on) plus the parameters its check needs. The check is the one place
that says whether a reply does what was asked: `kiln eval --chat-tasks` counts successes with it
and reinforcement learning can use `score` as a reward, so both judge alike.

- words:     "Write a story that uses the words A, B and C."  (three keywords of the story's
             opening, in the story's order)  check: each word appears, as a whole word in any case
- name:      "Write a story about a girl named N."  (a "girl named X" story, X renamed to N)
             check: N appears, as a whole word
- continue:  "Continue this story: <first half>"  (the reply: the second half)
             check: the start's first sentence is not repeated, and at least two keywords of the
             start that the real second half carries on appear (it goes on about the same things)
- sentences: "Write a story of about K sentences."  (K: the story's own count)
             check: K sentences, give or take max(1, K/5)
- shorter:   a short story, then "Now make it shorter."  (the reply: its first and last
             sentences)  check: at most 3/4 of the words of the story before it, and two of the
             target's keywords (it retells that story)
- happier:   a short story, then "Now make it happier."  (the reply: its sad words swapped for
             happy ones, and a happy ending)  check: more happy words than the story before it,
             no sad words or fewer, and two of its keywords
- include:   a short story, then "Now put a <thing> in it."  (the reply: the story with the
             thing found in it)  check: the thing is named (or its plural), and two keywords

A story's keywords are its content words (not stopwords) that are not common in the corpus
(in 5% of its stories or more: "happy", "play", "Lily" are in most), so a reply cannot pass by
writing any TinyStories story. Every check also needs a reply of at least five words.
`score` is in [0, 1] (the fraction of what was asked that the reply does); `check` is True when
the reply does all of it.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import KilnError

Params = dict[str, Any]

# Ends of sentences: runs of . ! ? with closing quotes, before the end or white space and a
# character that is not a lowercase letter ('"Catch it!" she said.' is one sentence).
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)]*(?=\s*$|\s+[^a-z\s])")
_WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")
_GIRL_NAMED = re.compile(r"\bgirl named ([A-Z][a-z]+)\b")

# Words too common to show that a reply used what the prompt gave it.
_STOPWORD_TEXT = """a an and are as at be been but by can could did do does for from had has have he her
    him his how i if in into is it its let me my no not of on one or our out said saw she so
    some that the their them then there they this to too up us very was we went were what
    when who will with would you your all day got get go just like little big time once upon
    about after again back came come did down each more much now off over see two away"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())
GIRL_NAMES = (
    "Anna", "Ava", "Bella", "Chloe", "Daisy", "Ella", "Emma", "Grace", "Hannah", "Ivy", "Jane",
    "Kate", "Lily", "Lucy", "Maya", "Mia", "Nora", "Olivia", "Rosa", "Ruby", "Sara", "Sophie",
    "Sue", "Tina", "Zoe",
)  # fmt: skip

MIN_WORDS = 5  # a reply shorter than this is not a story (nor a continuation, nor shorter one)


# ---- text measures (used by both the builders and the checks) -----------------------------------


def sentences(text: str) -> list[str]:
    """The sentences of `text`; a trailing fragment without an end mark counts as one."""
    out, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        piece = text[start : match.end()].strip()
        if _WORD.search(piece):
            out.append(piece)
        start = match.end()
    tail = text[start:].strip()
    if _WORD.search(tail):
        out.append(tail)
    return out


def words(text: str) -> list[str]:
    """The words of `text`, lowercased."""
    return [w.lower() for w in _WORD.findall(text)]


def content_words(text: str) -> set[str]:
    """The distinct words of `text` that are not stopwords."""
    return {w for w in words(text) if w not in STOPWORDS and len(w) > 2}


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text, flags=re.IGNORECASE) is not None


def _is_story(reply: str) -> bool:
    return len(words(reply)) >= MIN_WORDS


# ---- the tasks ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One task made from one story: the conversation (ending in the target reply) and params."""

    task: str
    story: int
    messages: list[dict[str, str]]
    params: Params = field(default_factory=dict)

    @property
    def prompt(self) -> list[dict[str, str]]:
        """The conversation without its final reply (what a model is asked)."""
        return self.messages[:-1]

    @property
    def target(self) -> str:
        """The reference reply."""
        return self.messages[-1]["content"]

    def to_json(self) -> dict[str, Any]:
        """The JSON-lines record (`messages` for training, `task` and `params` for checking)."""
        return {
            "id": f"{self.task}-{self.story}",
            "task": self.task,
            "story": self.story,
            "messages": self.messages,
            "params": self.params,
        }


@dataclass(frozen=True)
class Story:
    """What a task is made from: a story, a seeded generator, and the corpus's common words."""

    text: str
    rng: random.Random
    common: frozenset[str] = frozenset()  # `common_words` of the corpus the story is from

    def keywords(self, text: str, also_in: str | None = None) -> list[str]:
        """The content words of `text` (and of `also_in`, when given) rare enough in the corpus
        to show a reply is about it; the plain content words when none are rare."""
        found = content_words(text)
        if also_in is not None:
            found &= content_words(also_in)
        return sorted(found - self.common or found)


Made = tuple[list[dict[str, str]], Params] | None


@dataclass(frozen=True)
class ChatTask:
    """A task: how to make it from a story (None: the story does not fit) and how to score."""

    name: str
    description: str
    make: Callable[[Story], Made]
    score: Callable[[Params, str], float]


COMMON_SHARE = 0.05  # a word in at least this share of the corpus's stories is "common"
KEYWORDS_NEEDED = 2  # a reply about a story names at least this many of its keywords


def common_words(stories: Iterable[str], share: float = COMMON_SHARE) -> frozenset[str]:
    """The content words found in at least `share` of the stories (no evidence of topic)."""
    counts: Counter[str] = Counter()
    n = 0
    for story in stories:
        counts.update(content_words(story))
        n += 1
    return frozenset(w for w, c in counts.items() if c >= share * n)


def _keyword_share(keywords: list[str], reply: str) -> float:
    """The share of the needed keywords the reply names (1.0 when none are needed)."""
    if not keywords:
        return 1.0
    shared = len(set(keywords) & content_words(reply))
    return min(1.0, shared / min(KEYWORDS_NEEDED, len(keywords)))


def _turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in pairs]


WORDS_WINDOW = 60  # "words": the three words come from the story's first this-many words


def _make_words(story: Story) -> Made:
    """Three of the story's keywords, from its opening, written as the story writes them, listed
    in the order the story uses them.

    Each choice makes the task learnable by a small model: a word drawn from anywhere in a story
    of ~160 words had to be carried through a hundred of them (and was often past the row or the
    reply cap); a name or a sentence-initial word was given lowercased ("lucy"), a different
    token from the story's "Lucy"; in story order, the reply uses the first word first.
    """
    opening = " ".join(story.text.split()[:WORDS_WINDOW])
    as_written = {w for w in _WORD.findall(opening) if w.islower() and w.isalpha()}
    rare = [w for w in story.keywords(opening) if w in as_written]
    if len(rare) < 3:
        return None
    order = words(story.text)
    chosen = sorted(story.rng.sample(rare, 3), key=order.index)
    prompt = f"Write a story that uses the words {chosen[0]}, {chosen[1]} and {chosen[2]}."
    return _turns(("user", prompt), ("assistant", story.text)), {"words": chosen}


def _score_words(params: Params, reply: str) -> float:
    wanted = params["words"]
    if not _is_story(reply):
        return 0.0
    return sum(_has_word(reply, w) for w in wanted) / len(wanted)


def _make_name(story: Story) -> Made:
    match = _GIRL_NAMED.search(story.text)
    if match is None:
        return None
    name = story.rng.choice(GIRL_NAMES)
    renamed = re.sub(rf"\b{match.group(1)}\b", name, story.text)
    prompt = f"Write a story about a girl named {name}."
    return _turns(("user", prompt), ("assistant", renamed)), {"name": name}


def _score_name(params: Params, reply: str) -> float:
    return float(_is_story(reply) and re.search(rf"\b{params['name']}\b", reply) is not None)


def _make_continue(story: Story) -> Made:
    parts = sentences(story.text)
    if len(parts) < 4:
        return None
    half = len(parts) // 2
    start, rest = " ".join(parts[:half]), " ".join(parts[half:])
    return (
        _turns(("user", f"Continue this story: {start}"), ("assistant", rest)),
        {"start": start, "keywords": story.keywords(start, also_in=rest)},
    )


def _score_continue(params: Params, reply: str) -> float:
    """A continuation: a story of its own (not the start repeated) about the start's things."""
    if not _is_story(reply):
        return 0.0
    first = sentences(params["start"])[0]
    if first.lower() in reply.lower():
        return 0.0  # restarted the story instead of continuing it
    return _keyword_share(params["keywords"], reply)


def _make_sentences(story: Story) -> Made:
    k = len(sentences(story.text))
    if not 3 <= k <= 15:
        return None
    prompt = f"Write a story of about {k} sentences."
    return _turns(("user", prompt), ("assistant", story.text)), {"sentences": k}


def sentence_tolerance(k: int) -> int:
    """How far from K sentences is still "about K": one, or a fifth of K when that is more."""
    return max(1, round(k / 5))


def _score_sentences(params: Params, reply: str) -> float:
    if not _is_story(reply):
        return 0.0
    k = params["sentences"]
    off = abs(len(sentences(reply)) - k)
    return 1.0 if off <= sentence_tolerance(k) else max(0.0, 1.0 - off / k)


# ---- refine: a short story, then a change to it (the Storyteller page's "Ask for a change") -----

REFINE_SENTENCES = 4  # the first turn's story: its first sentences, short enough for a second turn
REFINE_MAX_WORDS = 70
_HAPPY_TEXT = """happy happily glad joy joyful smile smiled smiles smiling laugh laughed laughing
    fun love loved hug hugged cheer cheered cheerful excited proud kind friends friend nice great
    wonderful best yay"""
_SAD_TEXT = """sad sadly cry cried crying tears angry mad scared afraid upset hurt lonely bad broke
    broken lost sick worried frown frowned mean sorry fear scary fight"""
HAPPY_WORDS, SAD_WORDS = frozenset(_HAPPY_TEXT.split()), frozenset(_SAD_TEXT.split())
# "make it happier": each sad word becomes a happy one, and the story ends happily.
HAPPIER_SWAPS = {
    "sad": "happy", "sadly": "happily", "cry": "smile", "cried": "smiled", "crying": "smiling",
    "tears": "smiles", "angry": "cheerful", "mad": "glad", "scared": "excited",
    "afraid": "excited", "upset": "glad", "hurt": "fine", "lonely": "happy", "bad": "good",
    "broke": "fixed", "broken": "fixed", "lost": "found", "sick": "well", "worried": "calm",
    "frown": "smile", "frowned": "smiled", "mean": "kind", "sorry": "glad", "fear": "joy",
    "scary": "funny", "fight": "game",
}  # fmt: skip
HAPPY_ENDING = "In the end, everyone was happy, and they all smiled and laughed together."
THINGS = (
    "dragon", "robot", "rainbow", "balloon", "kite", "puppy", "kitten", "cake", "boat", "star",
    "hat", "train", "castle", "frog", "owl", "drum", "treasure", "rocket", "unicorn", "bike",
)  # fmt: skip


def _mood(text: str) -> tuple[int, int]:
    """(happy words, sad words) of a text."""
    ws = words(text)
    return sum(w in HAPPY_WORDS for w in ws), sum(w in SAD_WORDS for w in ws)


def _short_story(story: Story) -> str | None:
    parts = sentences(story.text)[:REFINE_SENTENCES]
    short = " ".join(parts)
    if len(parts) < 3 or len(words(short)) > REFINE_MAX_WORDS:
        return None
    return short


def _refine(story: Story, short: str, ask: str, reply: str) -> list[dict[str, str]]:
    return _turns(("user", "Tell me a short story."), ("assistant", short), ("user", ask),
                  ("assistant", reply))  # fmt: skip


SHORTER_RATIO = 0.75  # "shorter": at most this fraction of the previous story's words


def _make_shorter(story: Story) -> Made:
    """The short story's first and last sentences (its middle dropped), when that is short enough.

    The first turn is a short story, as in the other refine tasks: a whole TinyStories story and
    its retelling did not fit the 256-token context, so most held-out prompts were skipped.
    """
    short = _short_story(story)
    if short is None:
        return None
    parts = sentences(short)
    retold = f"{parts[0]} {parts[-1]}"
    if len(words(retold)) > SHORTER_RATIO * len(words(short)):
        return None
    messages = _refine(story, short, "Now make it shorter.", retold)
    return messages, {"previous_words": len(words(short)), "keywords": story.keywords(retold)}


def _score_shorter(params: Params, reply: str) -> float:
    """Shorter than the story before it (in words), and still about that story."""
    if not _is_story(reply):
        return 0.0
    n, before = len(words(reply)), params["previous_words"]
    limit = SHORTER_RATIO * before
    length = 1.0 if n <= limit else max(0.0, 1.0 - (n - limit) / before)
    return (length + _keyword_share(params["keywords"], reply)) / 2


def _make_happier(story: Story) -> Made:
    short = _short_story(story)
    if short is None:
        return None

    def swap(match: re.Match[str]) -> str:
        word = match.group(0)
        new = HAPPIER_SWAPS.get(word.lower())
        if new is None:
            return word
        return new.capitalize() if word[0].isupper() else new

    happier = f"{_WORD.sub(swap, short)} {HAPPY_ENDING}"
    happy, sad = _mood(short)
    params = {"previous_happy": happy, "previous_sad": sad, "keywords": story.keywords(short)}
    return _refine(story, short, "Now make it happier.", happier), params


def _score_happier(params: Params, reply: str) -> float:
    """Happier than the story before it (more happy words, fewer or no sad ones), same story."""
    if not _is_story(reply):
        return 0.0
    happy, sad = _mood(reply)
    more_joy = float(happy > params["previous_happy"])
    less_sorrow = float(sad == 0 or sad < params["previous_sad"])
    return (more_joy + less_sorrow + _keyword_share(params["keywords"], reply)) / 3


def _make_include(story: Story) -> Made:
    short = _short_story(story)
    if short is None:
        return None
    present = set(words(story.text))
    things = [t for t in THINGS if t not in present and t + "s" not in present]
    if not things:
        return None
    thing = story.rng.choice(things)
    parts = sentences(short)
    article = "an" if thing[0] in "aeiou" else "a"
    added = [parts[0], f"One day, they found {article} {thing}.", *parts[1:],
             f"They loved the {thing}."]  # fmt: skip
    ask = f"Now put {article} {thing} in it."
    return _refine(story, short, ask, " ".join(added)), {
        "thing": thing, "keywords": story.keywords(short),
    }  # fmt: skip


def _score_include(params: Params, reply: str) -> float:
    """The asked-for thing is in the story (or several of it), which is still the same story."""
    if not _is_story(reply):
        return 0.0
    thing = params["thing"]
    has = any(_has_word(reply, w) for w in (thing, thing + "s", thing + "es"))
    return (float(has) + _keyword_share(params["keywords"], reply)) / 2


TASKS: dict[str, ChatTask] = {
    t.name: t
    for t in (
        ChatTask("words", "uses the three given words", _make_words, _score_words),
        ChatTask("name", "names the girl as asked", _make_name, _score_name),
        ChatTask("continue", "continues the given start", _make_continue, _score_continue),
        ChatTask("sentences", "about K sentences", _make_sentences, _score_sentences),
        ChatTask("shorter", "a shorter retelling", _make_shorter, _score_shorter),
        ChatTask("happier", "the story, made happier", _make_happier, _score_happier),
        ChatTask("include", "the story, with a given thing in it", _make_include, _score_include),
    )
}


def make_example(
    task: str,
    story: str,
    story_id: int,
    rng: random.Random,
    common: frozenset[str] = frozenset(),
) -> Example | None:
    """Task `task` made from one story, or None when the story does not fit that task.

    `common` (`common_words` of the corpus) keeps words every story uses out of the drawn
    words and the keywords a reply must name.
    """
    made = TASKS[task].make(Story(story.strip(), rng, common))
    if made is None:
        return None
    messages, params = made
    return Example(task, story_id, messages, params)


def _task_of(record: Mapping[str, Any]) -> ChatTask:
    name = record.get("task")
    if name not in TASKS:
        raise KilnError(f"task {name!r} is not one of {', '.join(TASKS)}")
    if not isinstance(record.get("params"), Mapping):
        raise KilnError(f"task {record.get('id', name)!r}: no 'params' object")
    return TASKS[name]


def score(record: Mapping[str, Any], response: str) -> float:
    """How much of what task `record` asked the reply does, in [0, 1] (a reward for RL)."""
    task = _task_of(record)
    try:
        return float(task.score(dict(record["params"]), response))
    except (KeyError, TypeError, IndexError) as exc:
        raise KilnError(f"task {record.get('id', task.name)!r}: bad params ({exc})") from None


def check(record: Mapping[str, Any], response: str) -> bool:
    """Whether the reply does everything task `record` asked."""
    return score(record, response) >= 1.0
