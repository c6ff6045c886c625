"""The checkable tasks: the reference replies pass their checks, replies that miss fail."""

from __future__ import annotations

import random

import pytest

from kiln.errors import KilnError
from kiln.posttrain.tasks import TASKS, check, common_words, make_example, score, sentences

STORY = (
    "Once upon a time, there was a little girl named Lily. She had a red ball. "
    'Lily liked to play with her dog Max in the park. "Catch it!" she said. '
    "Max ran after the ball and brought it back. Lily laughed and hugged him. "
    "They went home happy."
)


def record(task: str, seed: int = 0) -> dict:
    example = make_example(task, STORY, 7, random.Random(seed))
    assert example is not None
    return example.to_json()


@pytest.mark.parametrize("task", list(TASKS))
def test_each_task_made_from_a_story_passes_with_its_own_target(task: str) -> None:
    r = record(task)
    assert r["task"] == task and r["story"] == 7 and r["messages"][-1]["role"] == "assistant"
    assert check(r, r["messages"][-1]["content"])
    assert score(r, r["messages"][-1]["content"]) == 1.0
    assert not check(r, "") and not check(r, "The end.")


def test_words_needs_every_word_and_scores_the_fraction() -> None:
    r = record("words")
    a, b, c = r["params"]["words"]
    assert r["messages"][0]["content"] == f"Write a story that uses the words {a}, {b} and {c}."
    assert {a, b, c} <= set(STORY.lower().replace(".", " ").replace(",", " ").split())
    assert check(r, f"One day {a.upper()} met {b} and also {c} in the sun.")
    two = f"One day {a} met {b} and nobody else in the sun."
    assert not check(r, two) and score(r, two) == pytest.approx(2 / 3)


def test_name_renames_the_girl_and_checks_for_the_name() -> None:
    r = record("name", seed=3)
    name = r["params"]["name"]
    assert r["messages"][0]["content"] == f"Write a story about a girl named {name}."
    target = r["messages"][-1]["content"]
    assert f"girl named {name}" in target and (name == "Lily" or "Lily" not in target)
    other = "Zoe" if name != "Zoe" else "Anna"
    assert not check(r, f"Once there was a girl named {other}. She was kind.")
    assert check(r, f"Once there was a girl named {name}. She was kind.")


def test_continue_gives_the_first_half_and_refuses_a_restart() -> None:
    r = record("continue")
    start = r["params"]["start"]
    parts = sentences(STORY)
    assert r["messages"][0]["content"] == f"Continue this story: {start}"
    assert start == " ".join(parts[: len(parts) // 2])
    assert not check(r, start + " Then Max ran after the ball.")  # the story again
    assert check(r, "Then Max and Lily ran after the ball all day.")
    assert not check(r, "Then a robot flew to the moon and sang all night.")  # unrelated


def test_sentences_counts_about_k() -> None:
    r = record("sentences")
    k = r["params"]["sentences"]
    assert k == 7 and r["messages"][0]["content"] == "Write a story of about 7 sentences."
    assert check(r, "A cat sat. " * 6 + "The end came at last")  # 7 (a tail fragment counts)
    assert check(r, "A cat sat. " * 8)
    assert not check(r, "A cat sat on a mat. " * 3)
    assert 0 < score(r, "A cat sat. " * 5) < 1


def test_shorter_is_multi_turn_and_needs_fewer_words() -> None:
    r = record("shorter")
    roles = [m["role"] for m in r["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"]
    short = " ".join(sentences(STORY)[:4])  # a short story first, as in happier and include
    assert (
        r["messages"][1]["content"] == short
        and r["messages"][2]["content"] == "Now make it shorter."
    )
    assert (
        r["messages"][3]["content"]
        == 'Once upon a time, there was a little girl named Lily. "Catch it!" she said.'
    )
    assert not check(r, short)
    assert check(r, "A girl named Lily played catch with her dog.")
    assert not check(r, "A robot flew to the moon and sang.")  # short, but another story


def test_a_record_without_a_known_task_is_a_clear_error() -> None:
    with pytest.raises(KilnError, match="task 'poem' is not one of"):
        check({"task": "poem", "params": {}}, "x")
    with pytest.raises(KilnError, match="bad params"):
        check({"task": "words", "params": {}}, "a b c d e f")


def test_common_words_are_not_drawn_nor_counted_as_keywords() -> None:
    others = ["Lily was happy. She had a ball.", "Tom had a ball. Lily was happy too."] * 10
    common = common_words([STORY, *others])
    assert {"lily", "ball", "happy"} <= common and "hugged" not in common
    for seed in range(5):
        example = make_example("words", STORY, 7, random.Random(seed), common)
        assert example is not None and not set(example.params["words"]) & common
    example = make_example("continue", STORY, 7, random.Random(0), common)
    assert example is not None and not set(example.params["keywords"]) & common
    generic = "Lily was happy with her ball and she played all day long."
    assert check(example.to_json(), "Max ran and brought the ball back to the park.")
    assert not check(example.to_json(), generic)  # only words every story has


SAD_STORY = (
    "Once upon a time, a boy named Tom lost his red kite in the tall tree. He was sad and "
    "cried. His dog barked at the tree. Tom sat alone under the big tree. Then it got dark."
)


def test_words_come_from_the_opening_as_written_and_in_story_order() -> None:
    late = "Later the zebra and the walrus visited the volcano near the harbour."
    story = f"{STORY} {'The sun was warm. ' * 4}{late}"  # the late words: past the first 60
    assert len(story.split()) - len(late.split()) > 60
    for seed in range(20):
        example = make_example("words", story, 1, random.Random(seed))
        assert example is not None
        drawn = example.params["words"]
        assert not {"zebra", "walrus", "volcano", "harbour"} & set(drawn)
        assert not {"lily", "max", "catch"} & set(drawn)  # only as the story writes them
        text = story.lower()
        assert drawn == sorted(drawn, key=lambda w: text.index(w))


def test_happier_needs_more_joy_less_sorrow_and_the_same_story() -> None:
    r = make_example("happier", SAD_STORY, 3, random.Random(0))
    assert r is not None
    record = r.to_json()
    assert [m["content"] for m in r.messages if m["role"] == "user"] == [
        "Tell me a short story.",
        "Now make it happier.",
    ]
    assert record["params"]["previous_sad"] == 3  # lost, sad, cried
    good = "Tom found his red kite in the tall tree. He was happy and smiled. His dog barked."
    fewer = "Tom lost his kite in the tree, but he smiled and was happy. His dog barked."
    assert check(record, good) and check(record, fewer)
    unchanged = r.messages[1]["content"]
    sadder = "Tom lost his kite in the tree and cried and cried. He was sad and angry."
    elsewhere = "Anna smiled and laughed with her friends at the fun party all day."
    for bad in (unchanged, sadder, elsewhere, "Happy."):
        assert not check(record, bad), bad
    assert "cried" not in r.target and "smiled" in r.target  # the target swapped the sad words


def test_include_needs_the_thing_in_the_same_story() -> None:
    r = make_example("include", STORY, 3, random.Random(0))
    assert r is not None
    record = r.to_json()
    thing = record["params"]["thing"]
    article = "an" if thing[0] in "aeiou" else "a"
    assert r.messages[2]["content"] == f"Now put {article} {thing} in it."
    assert thing not in STORY.lower()
    good = f"Lily had a red ball and a {thing}. Max the dog ran after the ball in the park."
    plural = f"Lily had a red ball and two {thing}s. Max the dog ran after the ball in the park."
    assert check(record, good) and check(record, plural)
    without = "Lily had a red ball. Max the dog ran after the ball in the park."
    unrelated = f"The {thing} flew over the moon and the sea at night."
    for bad in (without, unrelated, f"A {thing}."):
        assert not check(record, bad), bad
    assert score(record, without) == pytest.approx(0.5)  # the same story, without the thing
