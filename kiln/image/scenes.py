"""The procedural scene grammar: what a caption may say, and the held-out compositions.

A scene is one group of 1–3 like objects in a place ("two small red balls on the grass") or two
single objects in a relation ("a red ball under a green tree"). The things are the 28 kinds the
Storyteller's page draws (its "person" split into girl and boy), each with the colours it may
have and the places it may be. Every caption names the colour of every object that has one, so
the picture never shows a colour the caption did not say.

Unseen compositions: a fixed set of (kind, colour) and (kind, relation or place) pairs is held
out. Training and validation scenes never contain one; every held-out scene contains at least
one, so a model that draws them right has composed what it learnt, not recalled a picture. The
set is a function of the grammar alone (not of a dataset's seed): every dataset built with this
kiln holds out the same pairs, and the manifest records them.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

# Caption colour -> the RGB it is drawn in (before each picture's shade jitter).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "orange": (245, 140, 30), "yellow": (250, 215, 40),
    "green": (50, 160, 60), "blue": (40, 90, 220), "purple": (140, 60, 180),
    "pink": (245, 130, 190), "brown": (130, 80, 40), "white": (245, 245, 245),
    "black": (30, 30, 30), "grey": (140, 140, 145),
}  # fmt: skip

SIZES: dict[str, float] = {"small": 0.7, "big": 1.35}  # caption word -> scale; no word: 1.0
PLACES: dict[str, str] = {"sky": "in the sky", "grass": "on the grass", "water": "on water"}
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "under")
NUMBERS = {1: "a", 2: "two", 3: "three"}


@dataclass(frozen=True)
class Kind:
    """One kind of thing: its words, where it may be, its colours, its size in the picture."""

    name: str
    plural: str
    places: tuple[str, ...]  # keys of PLACES; the first is where it usually is
    colours: tuple[str, ...]  # the first is the usual one; () for a thing of fixed colours
    width: float  # box width and height at scale 1, as fractions of the picture's side
    height: float
    countable: bool = True  # may come two or three at a time

    @property
    def region(self) -> str:
        """'sky' or 'ground' (grass and water are both ground, below the horizon)."""
        return "sky" if self.places[0] == "sky" else "ground"


def _k(name: str, plural: str, places: str, colours: str, w: float, h: float, many: bool = True):
    return Kind(name, plural, tuple(places.split()), tuple(colours.split()), w, h, many)


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        _k("sun", "suns", "sky", "yellow orange red", 0.24, 0.24, many=False),
        _k("moon", "moons", "sky", "white yellow orange", 0.22, 0.22, many=False),
        _k("star", "stars", "sky", "yellow white pink", 0.12, 0.12),
        _k("cloud", "clouds", "sky", "white grey pink", 0.3, 0.17),
        _k("bird", "birds", "sky grass", "red blue yellow black brown", 0.16, 0.12),
        _k("kite", "kites", "sky", "red blue green yellow purple orange pink", 0.14, 0.2),
        _k("rainbow", "rainbows", "sky", "", 0.5, 0.25, many=False),
        _k("plane", "planes", "sky", "white red blue grey yellow", 0.3, 0.14),
        _k("balloon", "balloons", "sky", "red blue green yellow purple pink orange", 0.12, 0.2),
        _k("tree", "trees", "grass", "green orange yellow red pink", 0.28, 0.42),
        _k("flower", "flowers", "grass", "red yellow pink purple white blue orange", 0.12, 0.2),
        _k("house", "houses", "grass", "red yellow blue white pink brown orange green", 0.3, 0.3),
        _k("castle", "castles", "grass", "grey white pink purple brown", 0.36, 0.36),
        _k("dog", "dogs", "grass", "brown black white grey orange", 0.22, 0.16),
        _k("cat", "cats", "grass", "black white grey orange brown", 0.2, 0.16),
        _k("bunny", "bunnies", "grass", "white grey brown pink", 0.16, 0.18),
        _k("bear", "bears", "grass", "brown black white", 0.2, 0.24),
        _k("frog", "frogs", "grass", "green yellow blue red", 0.15, 0.11),
        _k("duck", "ducks", "water grass", "yellow white brown", 0.16, 0.13),
        _k("ball", "balls", "grass water", "red blue green yellow purple orange pink", 0.12, 0.12),
        _k("car", "cars", "grass", "red blue green yellow black white orange", 0.3, 0.16),
        _k("boat", "boats", "water", "red blue brown white yellow green", 0.28, 0.24),
        _k("fish", "fish", "water", "orange red blue yellow purple pink", 0.16, 0.1),
        _k("cake", "cakes", "grass", "pink white brown yellow", 0.18, 0.18),
        _k("box", "boxes", "grass", "brown red blue green yellow purple", 0.16, 0.16),
        _k("toy", "toys", "grass", "red blue green yellow purple orange", 0.14, 0.14),
        _k("dragon", "dragons", "grass", "green red purple blue black orange", 0.32, 0.26),
        _k("girl", "girls", "grass", "red pink purple blue yellow green", 0.13, 0.3),
        _k("boy", "boys", "grass", "blue red green yellow orange purple", 0.13, 0.3),
    )
}

DRESSED = ("girl", "boy")  # their colour is what they wear
# Things a "under" may put something beneath (besides anything in the sky).
SHELTERS = ("tree",)
# Things too big to stand under or beside a tree's crown in a 32-pixel picture.
LARGE = ("house", "castle", "tree", "dragon")


@dataclass(frozen=True)
class Group:
    """`count` objects of one kind, colour and size; `place` is a key of PLACES."""

    kind: str
    colour: str | None  # None only for kinds without colours (the rainbow)
    size: str | None  # "small", "big" or None (ordinary)
    count: int
    place: str

    def phrase(self) -> str:
        """The noun phrase: "two small red balls", "an orange cat", "a boy in blue"."""
        kind = KINDS[self.kind]
        noun = kind.name if self.count == 1 else kind.plural
        if kind.name in DRESSED:  # the colour is the clothes': "a small girl in red"
            rest = " ".join(w for w in (self.size, noun) if w) + f" in {self.colour}"
        else:
            rest = " ".join(w for w in (self.size, self.colour, noun) if w)
        number = NUMBERS[self.count]
        if self.count == 1 and rest[0] in "aeiou":
            number = "an"
        return f"{number} {rest}"


@dataclass(frozen=True)
class Scene:
    """One group in its place, or two single objects: `groups[0]` `relation` `groups[1]`."""

    groups: tuple[Group, ...]
    relation: str | None = None

    def caption(self) -> str:
        """The scene's caption, e.g. "a red ball under a green tree"."""
        if self.relation is None:
            (group,) = self.groups
            return f"{group.phrase()} {PLACES[group.place]}"
        subject, obj = self.groups
        return f"{subject.phrase()} {self.relation} {obj.phrase()}"

    def pairs(self) -> set[tuple[str, str]]:
        """The (kind, colour) and (kind, relation or place phrase) pairs the scene composes."""
        # A place counts whether or not the caption says it: a duck drawn on the grass is a
        # duck on the grass in the picture, which is what a held-out pair keeps out of training.
        out = {(g.kind, g.colour) for g in self.groups if g.colour}
        out |= {(g.kind, PLACES[g.place]) for g in self.groups}
        if self.relation is not None:
            out.add((self.groups[0].kind, self.relation))
        return out

    def to_json(self) -> dict:
        """Plain data for a record."""
        return {"groups": [asdict(g) for g in self.groups], "relation": self.relation}


def relation_allowed(relation: str, subject: Kind, obj: Kind) -> bool:
    """Whether `subject relation obj` can be drawn so that it reads right."""
    if subject.name == obj.name:
        return False
    if relation in ("left of", "right of"):
        return subject.region == obj.region and not (
            subject.region == "sky" and "rainbow" in (subject.name, obj.name)
        )
    if relation == "above":
        return subject.region == "sky" and obj.region == "ground" and subject.name != "rainbow"
    # under: something on the ground beneath a thing in the sky or a tree's crown
    return (
        subject.region == "ground"
        and subject.name not in LARGE
        and (obj.region == "sky" or obj.name in SHELTERS)
    )


def _heldout_pairs() -> frozenset[tuple[str, str]]:
    """The held-out compositions: one unusual colour of each kind with four or more colours,
    one place of each kind with two, and ten (kind, relation) pairs."""
    rng = random.Random("kiln-image-heldout-v1")
    held = set()
    for kind in KINDS.values():
        if len(kind.colours) >= 4:
            held.add((kind.name, rng.choice(kind.colours[1:])))
        if len(kind.places) >= 2:
            held.add((kind.name, PLACES[kind.places[-1]]))
    candidates = sorted(
        (s.name, r)
        for s in KINDS.values()
        for r in RELATIONS
        if sum(relation_allowed(r, s, o) for o in KINDS.values()) >= 3
    )
    held |= set(rng.sample(candidates, 10))
    return frozenset(held)


HELDOUT: frozenset[tuple[str, str]] = _heldout_pairs()


def _group(rng: random.Random, kind: Kind, count: int, place: str | None = None) -> Group:
    colour = rng.choice(kind.colours) if kind.colours else None
    size = rng.choice((None, None, "small", "big"))
    return Group(kind.name, colour, size, count, place or rng.choice(kind.places))


def _draw_scene(rng: random.Random) -> Scene:
    kinds = list(KINDS.values())
    if rng.random() < 0.5:
        kind = rng.choice(kinds)
        count = rng.choice((1, 1, 2, 3)) if kind.countable else 1
        return Scene((_group(rng, kind, count),))
    while True:
        relation = rng.choice(RELATIONS)
        subject, obj = rng.choice(kinds), rng.choice(kinds)
        if relation_allowed(relation, subject, obj):
            # What is above is in the sky; what something is under is where it usually is.
            s_place = "sky" if relation == "above" else None
            o_place = obj.places[0] if relation == "under" else None
            groups = (_group(rng, subject, 1, s_place), _group(rng, obj, 1, o_place))
            return Scene(groups, relation)


def sample_scene(rng: random.Random, unseen: bool) -> Scene:
    """A random scene with no held-out pair (`unseen` False) or with at least one (True)."""
    while True:
        scene = _draw_scene(rng)
        if bool(scene.pairs() & HELDOUT) == unseen:
            return scene
