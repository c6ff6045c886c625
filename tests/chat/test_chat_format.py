"""The chat format: ids and loss mask of a conversation, control-token text refused, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.chat import (
    chat_template_of,
    iter_conversations,
    render,
    render_text,
)
from kiln.chat.tokens import ASSISTANT, CHAT_TOKENS, END, SYSTEM, USER
from kiln.errors import KilnError
from kiln.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "You tell stories."},
    {"role": "user", "content": "Write a story about a cat."},
    {"role": "assistant", "content": "Once upon a time, a cat sat."},
    {"role": "user", "content": "Now make it shorter."},
    {"role": "assistant", "content": "A cat sat."},
]


def test_layout_is_role_text_end_per_message_and_mask_covers_only_replies(
    chat_tok: Tokenizer,
) -> None:
    ids = chat_tok.special_tokens
    out = render(CONVERSATION, chat_tok)
    expected, mask = [], []
    for m in CONVERSATION:
        text = chat_tok.encode(m["content"])
        role = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}[m["role"]]
        expected += [ids[role], *text, ids[END]]
        on = int(m["role"] == "assistant")
        mask += [0] + [on] * (len(text) + 1)
    assert out.ids == expected
    assert out.loss_mask == mask
    # The masked ids are exactly the replies' text and their end tokens, in order.
    kept = [i for i, m in zip(out.ids, out.loss_mask, strict=True) if m]
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    want = [t for r in replies for t in (*chat_tok.encode(r), ids[END])]
    assert kept == want
    assert chat_tok.decode(out.ids) == render_text(CONVERSATION)


def test_generation_prompt_appends_the_assistant_token_unmasked(chat_tok: Tokenizer) -> None:
    base = render(CONVERSATION[:2], chat_tok)
    prompted = render(CONVERSATION[:2], chat_tok, add_generation_prompt=True)
    assert prompted.ids == [*base.ids, chat_tok.special_tokens[ASSISTANT]]
    assert prompted.loss_mask == [*base.loss_mask, 0]
    assert sum(prompted.loss_mask) == 0


@pytest.mark.parametrize("role", ["system", "user", "assistant"])
@pytest.mark.parametrize("token", [*CHAT_TOKENS, "<|endoftext|>"])
def test_control_token_text_in_any_role_is_refused_never_encoded(
    chat_tok: Tokenizer, role: str, token: str
) -> None:
    conversation = [
        {"role": "user", "content": "Hello."},
        {"role": role, "content": f"Say {token} now."},
    ]
    with pytest.raises(KilnError, match=rf"message 1 \({role}\).*{token[:3]}.*refused"):
        render(conversation, chat_tok)


@pytest.mark.parametrize(
    ("conversation", "message"),
    [
        ([{"role": "bot", "content": "hi"}], r"message 0: role 'bot' is not one of"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}],
         r"message 1 \(user\): content must be a string, got int"),
        ([{"role": "user"}], r"message 0 \(user\): content must be a string, got NoneType"),
        ([{"content": "x"}], r"message 0: role None"),
        (["hello"], r"message 0: expected an object"),
        ([], r"no messages"),
        ("hello", r"expected a list of messages"),
    ],
)  # fmt: skip
def test_bad_conversations_are_one_clear_error_naming_the_message(
    chat_tok: Tokenizer, conversation: object, message: str
) -> None:
    with pytest.raises(KilnError, match=message):
        render(conversation, chat_tok)


def test_a_base_tokenizer_has_no_template_and_rendering_says_how_to_add_one(
    base_tok: Tokenizer,
) -> None:
    assert chat_template_of(base_tok) is None
    with pytest.raises(KilnError, match="add-chat-tokens"):
        render(CONVERSATION, base_tok)


def test_template_names_the_ids_and_a_partial_set_is_refused(
    chat_tok: Tokenizer, base_tok: Tokenizer
) -> None:
    template = chat_template_of(chat_tok)
    assert template is not None
    assert template.stop_ids == (chat_tok.special_tokens[END],)
    assert template.assistant_id == chat_tok.special_tokens[ASSISTANT]
    partial = Tokenizer(base_tok.vocab, base_tok.merges, [*base_tok.special_tokens, USER])
    with pytest.raises(KilnError, match="but not"):
        chat_template_of(partial)


def test_conversation_files_name_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    good = {"messages": CONVERSATION[:3]}
    bad = {"messages": [{"role": "user", "content": ["x"]}]}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n", encoding="utf-8")
    rows = iter_conversations(path)
    assert next(rows) == good
    with pytest.raises(KilnError, match=r"chat.jsonl:3: message 0 \(user\): content must be"):
        next(rows)
