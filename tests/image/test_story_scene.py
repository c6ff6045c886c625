"""A story read as one scene caption: kinds, colours, sizes, counts, relations, places."""

from __future__ import annotations

import pytest

from kiln.image.scenes import KINDS, relation_allowed
from kiln.image.story_scene import scene_from_text


@pytest.mark.parametrize(
    ("story", "caption"),
    [
        # A relation the story states wins over the order things are named in.
        ("A little dog found a big red ball under a tree.", "a big red ball under a green tree"),
        ("A blue bird flew above the green house.", "a blue bird above a green house"),
        ("The grey cat sat left of a white dog.", "a grey cat left of a white dog"),
        # Two kinds, no stated relation: one the grammar can draw, either way round.
        ("The sun was high. A black cat slept.", "a yellow sun above a black cat"),
        # One kind: its count, size and a place the story speaks of.
        ("Lily saw two yellow ducks on the pond.", "two yellow ducks on water"),
        ("Three little stars came out.", "three small yellow stars in the sky"),
        ("The kite flew over the boy in blue.", "a red kite above a boy in blue"),
        # Everyday words for a kind; a colour the kind cannot have is left out.
        ("The puppy was happy.", "a brown dog on the grass"),
        ("The purple dog ran.", "a brown dog on the grass"),
    ],
)
def test_a_story_becomes_a_caption_of_the_grammar(story: str, caption: str) -> None:
    assert scene_from_text(story).caption == caption


def test_it_reports_what_it_found_and_falls_back_when_nothing_is_known() -> None:
    found = scene_from_text("The red ball and the Green tree and a gray cloud.")
    assert found.kinds == ("ball", "tree", "cloud") and found.colours == ("red", "green", "grey")
    assert found.summary() == {"kinds": ["ball", "tree", "cloud"],
                               "colours": ["red", "green", "grey"]}  # fmt: skip
    empty = scene_from_text("Once upon a time it rained.")
    assert empty.kinds == () and empty.caption == "a yellow sun in the sky"


def test_every_pair_of_kinds_gives_a_drawable_scene() -> None:
    for a in KINDS:
        for b in KINDS:
            scene = scene_from_text(f"There was a {a} and a {b}.").scene
            if scene.relation is not None:
                s, o = (KINDS[g.kind] for g in scene.groups)
                assert relation_allowed(scene.relation, s, o), scene
            for g in scene.groups:
                assert g.place in KINDS[g.kind].places or g.place == "sky"
                assert g.colour is None or g.colour in KINDS[g.kind].colours
