"""Replies on the engine: greedy equals kiln.model.generate; stopping early cancels cleanly."""

from __future__ import annotations

from pathlib import Path

from kiln.chat import chat_template_of, render
from kiln.loading import load_model
from kiln.model.generate import generate
from kiln.posttrain.replies import ReplyGenerator, ReplySettings, reply_stop_ids


def test_greedy_replies_equal_the_reference_decoder_alone_and_batched(chat_run: Path) -> None:
    loaded = load_model(chat_run, dtype="fp32")
    tok = loaded.tokenizer
    assert tok is not None
    template = chat_template_of(tok)
    assert template is not None
    stops = reply_stop_ids(loaded, template.stop_ids)
    assert stops == tuple(sorted({template.end_id, loaded.eot_id}))
    prompts = [
        render([{"role": "user", "content": text}], tok, add_generation_prompt=True).ids
        for text in ("Hi.", "Write a story about a dog.", "Continue this story: Once upon a time")
    ]
    greedy = ReplySettings(temperature=0, max_tokens=20)
    expected = [
        generate(loaded.model, [p], 20, temperature=0, stop_tokens=stops)[0] for p in prompts
    ]
    generator = ReplyGenerator(loaded, stops, max_batch=2)
    assert generator.generate(prompts, greedy) == expected
    assert list(generator.stream(prompts[1], greedy)) == expected[1]
    first_two = []
    for token in generator.stream(prompts[2], greedy):  # stop reading early: cancelled
        first_two.append(token)
        if len(first_two) == 2:
            break
    assert first_two == expected[2][:2]
    assert generator.generate(prompts[:1], greedy) == expected[:1]  # still works afterwards
