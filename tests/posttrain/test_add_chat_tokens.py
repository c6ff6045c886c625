"""Chat tokens: reserved by `kiln tokenizer train --chat`, added to a base model by
`kiln posttrain add-chat-tokens` (new folder, ids kept, rows grown to the mean, loads, generates)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.chat import chat_template_of, render
from kiln.chat.tokens import CHAT_TOKENS
from kiln.cli import main
from kiln.io import sha256_file
from kiln.loading import load_model
from kiln.model.generate import generate
from kiln.posttrain.add_chat_tokens import add_chat_tokens
from kiln.tokenizer import Tokenizer
from kiln.tokenizer.special import EOT
from tests.posttrain.conftest import save_run, tiny_model


def test_tokenizer_train_chat_reserves_the_chat_tokens(
    tmp_path: Path, stories_text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "corpus.txt").write_text(stories_text, encoding="utf-8")
    out = tmp_path / "tok.json"
    args = ["tokenizer", "train", str(tmp_path / "corpus.txt"), "--vocab-size", "300"]
    assert main([*args, "--chat", "--workers", "1", "-o", str(out)]) == 0
    tok = Tokenizer.load(out)
    assert list(tok.special_tokens) == [EOT, *CHAT_TOKENS]
    assert tok.n_vocab == 300 and chat_template_of(tok) is not None
    assert main([*args, "--chat", "--no-special-tokens", "-o", str(tmp_path / "x.json")]) == 2
    assert "contradict" in capsys.readouterr().err


def test_add_chat_tokens_keeps_every_id_and_grows_rows_to_the_mean(
    base_run: Path, chat_run: Path, base_tok: Tokenizer
) -> None:
    base, chat = load_model(base_run, dtype="fp32"), load_model(chat_run, dtype="fp32")
    assert chat.tokenizer is not None and base.tokenizer is not None
    new = {t: chat.tokenizer.special_tokens[t] for t in CHAT_TOKENS}
    assert sorted(new.values()) == list(range(base_tok.n_vocab, base_tok.n_vocab + 4))
    for i, b in base_tok.vocab.items():
        assert chat.tokenizer.vocab[i] == b  # never renumbered
    assert chat.tokenizer.special_tokens[EOT] == base_tok.special_tokens[EOT] == chat.eot_id
    old_v = base.model.cfg.vocab_size
    assert chat.model.cfg.vocab_size == old_v + 4
    for name in ("wte.weight", "lm_head.weight"):
        before, after = base.model.state_dict()[name], chat.model.state_dict()[name]
        assert torch.equal(after[:old_v], before[:old_v])
        for i in new.values():
            torch.testing.assert_close(after[i], before[:old_v].mean(dim=0))
    rest = {
        k: v
        for k, v in base.model.state_dict().items()
        if k not in ("wte.weight", "lm_head.weight")
    }
    for k, v in rest.items():
        assert torch.equal(chat.model.state_dict()[k], v), k
    record = json.loads((chat_run / "chat_tokens.json").read_text())
    assert record["rows_added"] == 4 and record["added"] == new
    # The old tokens' logits are unchanged; the result generates after a chat prompt.
    prompt = render([{"role": "user", "content": "Hi."}], chat.tokenizer, True).ids
    plain = chat.tokenizer.encode("Once upon a time")
    torch.testing.assert_close(
        chat.model.logits(chat.model.hidden(torch.tensor([plain])))[..., :old_v],
        base.model.logits(base.model.hidden(torch.tensor([plain]))),
    )
    out = generate(chat.model, [prompt], 5, temperature=0)
    assert len(out[0]) == 5


def test_padding_rows_are_used_not_grown_and_source_is_untouched(
    tmp_path: Path, base_tok: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    src = save_run(tmp_path / "src", tiny_model(512, tie_embeddings=True), base_tok)
    before = {p: sha256_file(p) for p in sorted(src.rglob("*")) if p.is_file()}
    assert main(["posttrain", "add-chat-tokens", str(src), str(tmp_path / "out")]) == 0
    line = capsys.readouterr().out
    assert "0 embedding row(s) added" in line and f"<|end|> = {base_tok.n_vocab + 3}" in line
    assert {p: sha256_file(p) for p in sorted(src.rglob("*")) if p.is_file()} == before
    chat = load_model(tmp_path / "out", dtype="fp32")
    weight = chat.model.wte.weight
    real = sorted(base_tok.vocab)
    torch.testing.assert_close(weight[base_tok.n_vocab + 1], weight[real].mean(dim=0))
    assert chat.model.cfg.vocab_size == 512


def test_refuses_to_clobber_and_to_write_inside_the_source(
    base_run: Path, chat_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    cases = [
        ([str(base_run), str(tmp_path / "mine")], "already exists"),
        ([str(base_run), str(tmp_path / "mine"), "--force"], "refusing to replace"),
        ([str(base_run), str(base_run / "chat")], "inside the source"),
        ([str(base_run), str(base_run)], "inside the source"),
    ]
    for argv, message in cases:
        assert main(["posttrain", "add-chat-tokens", *argv]) == 2
        assert message in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    again = add_chat_tokens(chat_run, tmp_path / "again")
    assert again.added == {} and again.rows_added == 0
    replaced = add_chat_tokens(base_run, tmp_path / "again", force=True)
    assert len(replaced.added) == 4
