"""A story's words as one scene caption of the grammar in scenes.py, for "Illustrate".

The image model only knows the scene grammar's captions, so a story is read for the grammar's
words and re-told as one caption it can draw:

- kinds: each kind's name or plural ("dog", "dogs") or a few everyday words for one ("puppy",
  "kitten", "rabbit", "ship"), in the order the story first names them;
- a kind's colour: the closest colour word among the three words before its first mention with
  that colour allowed for the kind ("the big red ball"), else the kind's usual colour; its size
  ("small"/"little"/"tiny", "big"/"large"/"huge") and count ("two", "three") the same way;
- the scene: a relation the story states ("under"/"below", "above"/"over", "left of",
  "right of" with a kind in the five words before and after) if the grammar can draw it; else
  the first two kinds in the first relation it can draw (above, under, left of, either way
  round); one kind alone stands in its place (on water when the story speaks of
  water and the kind may float, in the sky or on the grass likewise). A story naming no kind
  is drawn as the grammar's sun in the sky, and says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.image.scenes import COLOURS, DRESSED, KINDS, Group, Scene, relation_allowed

ALIASES = {
    "puppy": "dog", "puppies": "dog", "doggy": "dog", "kitten": "cat", "kittens": "cat",
    "kitty": "cat", "rabbit": "bunny", "rabbits": "bunny", "ship": "boat", "ships": "boat",
    "teddy": "bear", "home": "house", "truck": "car", "aeroplane": "plane", "airplane": "plane",
    "present": "box", "gift": "box", "fishes": "fish",
}  # fmt: skip
COLOUR_WORDS = {**{c: c for c in COLOURS}, "gray": "grey"}
SIZE_WORDS = {"small": "small", "little": "small", "tiny": "small",
              "big": "big", "large": "big", "huge": "big"}  # fmt: skip
COUNT_WORDS = {"two": 2, "three": 3}
RELATION_WORDS = {"under": "under", "below": "under", "beneath": "under", "above": "above",
                  "over": "above"}  # fmt: skip
NEAR = 5  # words either side of a relation word that may hold its two things
PLACE_WORDS = {
    "water": ("water", "sea", "ocean", "river", "lake", "pond", "swim", "swam", "float"),
    "sky": ("sky", "fly", "flew", "flying", "air"),
    "grass": ("grass", "park", "garden", "field", "meadow"),
}
LOOK_BACK = 3  # words before a kind that may describe it
FALLBACK = Scene((Group("sun", "yellow", None, 1, "sky"),))
_WORD = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class StoryScene:
    """The caption drawn for a story and what was found in it."""

    caption: str
    kinds: tuple[str, ...]  # every kind the story names, in order of first mention
    colours: tuple[str, ...]  # every colour word it uses (normalised), in order
    scene: Scene

    def summary(self) -> dict:
        """Plain data for an API response: the caption's source words."""
        return {"kinds": list(self.kinds), "colours": list(self.colours)}


def _kind_of(word: str) -> str | None:
    if word in KINDS:
        return word
    for kind in KINDS.values():
        if word == kind.plural:
            return kind.name
    return ALIASES.get(word)


def _group(words: list[str], at: int, kind: str, count_ok: bool, place: str) -> Group:
    """The group the words just before position `at` describe."""
    k = KINDS[kind]
    before = words[max(0, at - LOOK_BACK) : at]
    if kind in DRESSED and words[at + 1 : at + 2] == ["in"]:
        before = [*before, *words[at + 2 : at + 3]]  # "a girl in red": the nearest of all
    colour = next(
        (COLOUR_WORDS[w] for w in reversed(before)
         if w in COLOUR_WORDS and COLOUR_WORDS[w] in k.colours), None,
    )  # fmt: skip
    if colour is None and k.colours:
        colour = k.colours[0]
    size = next((SIZE_WORDS[w] for w in reversed(before) if w in SIZE_WORDS), None)
    count = next((COUNT_WORDS[w] for w in reversed(before) if w in COUNT_WORDS), 1)
    if not (count_ok and k.countable):
        count = 1
    return Group(kind, colour, size, count, place)


def _stated(words: list[str], kinds: list[str | None]) -> Scene | None:
    """The first relation the story itself states between two kinds ("the dog sat under a
    tree"), if the grammar can draw it."""
    for p, word in enumerate(words):
        relation = RELATION_WORDS.get(word)
        if word in ("left", "right") and words[p + 1 : p + 2] == ["of"]:
            relation = f"{word} of"
        if relation is None:
            continue
        before = [i for i in range(max(0, p - NEAR), p) if kinds[i]]
        after = [i for i in range(p + 1, min(len(words), p + NEAR + 1)) if kinds[i]]
        if before and after:
            scene = _relate(words, relation, (before[-1], kinds[before[-1]]),
                            (after[0], kinds[after[0]]))  # fmt: skip
            if scene is not None:
                return scene
    return None


def _relate(
    words: list[str], relation: str, subject: tuple[int, str | None], obj: tuple[int, str | None]
) -> Scene | None:
    """`subject relation obj` as a scene of two single objects, or None if it cannot be drawn."""
    (si, s), (oi, o) = subject, obj
    if s is None or o is None or not relation_allowed(relation, KINDS[s], KINDS[o]):
        return None
    s_place = "sky" if relation == "above" else KINDS[s].places[0]
    first = _group(words, si, s, False, s_place)
    return Scene((first, _group(words, oi, o, False, KINDS[o].places[0])), relation)


def _pair(words: list[str], first: tuple[int, str], second: tuple[int, str]) -> Scene | None:
    """The first two kinds named in the first relation the grammar can draw, or None."""
    for relation in ("above", "under", "left of"):
        for a, b in ((first, second), (second, first)):
            scene = _relate(words, relation, a, b)
            if scene is not None:
                return scene
    return None


def _place(words: set[str], kind: str) -> str:
    """Where one kind alone stands: a place the story speaks of, if the kind may be there."""
    places = KINDS[kind].places
    for place, cues in PLACE_WORDS.items():
        if place in places and words.intersection(cues):
            return place
    return places[0]


def scene_from_text(text: str) -> StoryScene:
    """The scene caption for `text` (a story), built from the grammar's words it uses."""
    words = _WORD.findall(text.lower())
    kinds_at = [_kind_of(w) for w in words]
    mentions: list[tuple[int, str]] = []
    for i, kind in enumerate(kinds_at):
        if kind is not None and kind not in {k for _, k in mentions}:
            mentions.append((i, kind))
    colours = tuple(dict.fromkeys(COLOUR_WORDS[w] for w in words if w in COLOUR_WORDS))
    kinds = tuple(k for _, k in mentions)
    scene = _stated(words, kinds_at)
    if scene is None and len(mentions) >= 2:
        scene = _pair(words, mentions[0], mentions[1])
    if scene is None and mentions:
        at, kind = mentions[0]
        scene = Scene((_group(words, at, kind, True, _place(set(words), kind)),))
    scene = scene or FALLBACK
    return StoryScene(scene.caption(), kinds, colours, scene)
