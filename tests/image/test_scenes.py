"""The scene grammar and its pictures: captions, held-out compositions, ground truth."""

from __future__ import annotations

import random

import numpy as np

from kiln.image.render import SHAPES, render
from kiln.image.scenes import COLOURS, HELDOUT, KINDS, PLACES, RELATIONS, Group, Scene, sample_scene

PAGE_KINDS = {  # the Storyteller page's drawable nouns (its "person" is girl and boy here)
    "sun", "moon", "star", "cloud", "bird", "kite", "rainbow", "plane", "balloon", "tree",
    "flower", "house", "castle", "dog", "cat", "bunny", "bear", "frog", "duck", "ball", "car",
    "boat", "fish", "cake", "box", "toy", "dragon", "girl", "boy",
}  # fmt: skip


def test_every_kind_the_page_draws_has_words_colours_and_shapes() -> None:
    assert set(KINDS) == PAGE_KINDS == set(SHAPES)
    assert all(k.colours for k in KINDS.values() if k.name != "rainbow")


def test_captions_read_as_english() -> None:
    ball = Group("ball", "red", None, 1, "grass")
    tree = Group("tree", "green", "big", 1, "grass")
    assert Scene((ball, tree), "under").caption() == "a red ball under a big green tree"
    assert Scene((Group("cat", "orange", None, 1, "grass"),)).caption() == (
        "an orange cat on the grass"
    )
    assert Scene((Group("bunny", "white", "small", 3, "grass"),)).caption() == (
        "three small white bunnies on the grass"
    )
    assert Scene((Group("girl", "red", None, 2, "grass"),)).caption() == (
        "two girls in red on the grass"
    )


def test_heldout_pairs_never_reach_training_and_every_heldout_scene_has_one() -> None:
    rng = random.Random(0)
    seen = [sample_scene(rng, unseen=False) for _ in range(600)]
    unseen = [sample_scene(rng, unseen=True) for _ in range(300)]
    assert all(not (s.pairs() & HELDOUT) for s in seen)
    assert all(s.pairs() & HELDOUT for s in unseen)
    # Both kinds of composition are held out: colours, and relations or places.
    relations = {*RELATIONS, *PLACES.values()}
    assert {p for p in HELDOUT if p[1] in relations} and {p for p in HELDOUT if p[1] in COLOURS}
    # Each held-out kind keeps other colours to learn from.
    for kind, colour in HELDOUT:
        if colour in KINDS[kind].colours:
            assert set(KINDS[kind].colours) - {c for k, c in HELDOUT if k == kind}


def test_training_scenes_cover_every_kind_relation_and_count() -> None:
    rng = random.Random(1)
    scenes = [sample_scene(rng, unseen=False) for _ in range(3000)]
    assert {g.kind for s in scenes for g in s.groups} == set(KINDS)
    assert {s.relation for s in scenes} == {None, *RELATIONS}
    assert {g.count for s in scenes for g in s.groups} == {1, 2, 3}


def test_pictures_differ_and_boxes_obey_the_relation() -> None:
    rng = random.Random(2)
    ball = Group("ball", "red", None, 1, "grass")
    tree = Group("tree", "green", None, 1, "grass")
    pictures = []
    for _ in range(20):
        image, truth = render(Scene((ball, tree), "under"), 32, rng)
        pictures.append(np.asarray(image))
        (bx0, by0, bx1, by1), (tx0, ty0, tx1, ty1) = (o["box"] for o in truth["objects"])
        assert (by0 + by1) / 2 > (ty0 + ty1) / 2  # the ball is lower than the tree's middle
        assert bx1 > tx0 and bx0 < tx1  # and beneath it
        assert [o["kind"] for o in truth["objects"]] == ["ball", "tree"]
    assert pictures[0].shape == (32, 32, 3)
    assert len({p.tobytes() for p in pictures}) == 20  # jitter: no two alike


def test_the_colour_named_is_the_colour_drawn() -> None:
    rng = random.Random(3)
    for colour, rgb in (("red", (220, 40, 40)), ("blue", (40, 90, 220))):
        image, truth = render(Scene((Group("ball", colour, "big", 1, "grass"),)), 64, rng)
        x0, y0, x1, y1 = (round(c * 64) for c in truth["objects"][0]["box"])
        centre = np.asarray(image)[(y0 + y1) // 2 - 3, (x0 + x1) // 2]  # above the stripe
        assert np.abs(centre.astype(int) - rgb).max() < 60, centre
