"""`kiln export` of a chat model: transformers' apply_chat_template gives exactly kiln's ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.chat import render
from kiln.chat.tokens import CHAT_TOKENS, END
from kiln.cli import main
from kiln.loading import load_model

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Write a story about a girl named Lily."}],
    "system": [
        {"role": "system", "content": "You are a kind storyteller.\n"},
        {"role": "user", "content": "  Write a story that uses the words dog, ball and sun."},
    ],
    "multi": [
        {"role": "user", "content": "Continue this story: Once upon a time, there was a cat"},
        {"role": "assistant", "content": " named Tom. He liked to play. 🐱 The end."},
        {"role": "user", "content": "Now make it shorter."},
        {"role": "assistant", "content": "Tom the cat played.\n\nThe end!"},
        {"role": "user", "content": ""},
    ],
}


@pytest.fixture(scope="module")
def export(chat_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF export of the chat run."""
    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export", str(chat_run), "--hf", str(out)]) == 0
    return out


def test_export_writes_the_template_and_the_chat_special_tokens(export: Path) -> None:
    config = json.loads((export / "tokenizer_config.json").read_text())
    assert "{% for message in messages %}" in config["chat_template"]
    assert config["additional_special_tokens"] == list(CHAT_TOKENS)
    names = {entry["content"] for entry in config["added_tokens_decoder"].values()}
    assert set(CHAT_TOKENS) <= names


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_apply_chat_template_gives_kilns_ids(
    export: Path, name: str, add_generation_prompt: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(export))
    loaded = load_model(export, dtype="fp32")
    assert loaded.tokenizer is not None
    conversation = CONVERSATIONS[name]
    ours = render(conversation, loaded.tokenizer, add_generation_prompt).ids
    theirs = hf.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )["input_ids"]
    assert list(theirs) == ours
    assert hf.convert_tokens_to_ids(END) == loaded.tokenizer.special_tokens[END]


def test_a_base_export_has_no_chat_template(base_run: Path, tmp_path: Path) -> None:
    assert main(["export", str(base_run), "--hf", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert "chat_template" not in config and "additional_special_tokens" not in config
