"""`kiln chat`: driven through stdin in a subprocess (streaming, commands, Ctrl-C), and the
session's context handling in process."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.errors import KilnError
from kiln.loading import LoadedModel, load_model
from kiln.posttrain.chat_session import ChatSession, run_chat
from kiln.posttrain.replies import ReplySettings

ROOT = Path(__file__).resolve().parents[2]


def kiln_chat(model: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`kiln chat MODEL ...` in a subprocess with piped stdin/stdout/stderr."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "chat", str(model), "--dtype", "fp32", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=full_env, cwd=ROOT, preexec_fn=_default_sigint,
    )  # fmt: skip


def _default_sigint() -> None:
    """Ctrl-C reaches the child even when the suite runs in the background (SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def session_model(chat_run: Path) -> LoadedModel:
    return load_model(chat_run, dtype="fp32")


def test_a_conversation_through_stdin_commands_refusal_and_ctrl_c(
    chat_run: Path, tmp_path: Path
) -> None:
    env = {"KILN_TEST_WAIT_AT": "chat:reply-token", "KILN_TEST_WAIT_DIR": str(tmp_path)}
    proc = kiln_chat(chat_run, "--seed", "1", "--max-tokens", "12", env=env)
    assert proc.stdin is not None and proc.stderr is not None
    proc.stdin.write("Tell me a story.\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("*.ready")):  # the first reply token is out: Ctrl-C now
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    (tmp_path / "go").touch()
    lines = [
        "/temperature 0", "Write a story.", "/system Be kind.", "/bogus",
        "Say <|assistant|> now.", "/reset", "Write a story.", "/temperature x", "/quit",
        "never read",
    ]  # fmt: skip
    out, err = proc.communicate("\n".join(lines) + "\n", timeout=120)
    assert proc.returncode == 0, err
    assert "kiln chat: checkpoint" in err and "/help for commands" in err
    first, *rest = out.split("> ")[1:]
    assert first.rstrip("\n").endswith("[stopped]")  # the reply stopped, the chat went on
    assert "(temperature 0)" in out and "(system message: Be kind.)" in out
    assert "error: unknown command '/bogus'" in out
    assert "(user) contains the special token '<|assistant|>'" in out
    assert "(conversation reset)" in out and "error: /temperature needs a number" in out
    assert len(rest) == len(lines) - 1  # one prompt per line read up to /quit, none after


def test_a_base_model_without_chat_tokens_is_refused(
    base_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["chat", str(base_run)]) == 2
    err = capsys.readouterr().err
    assert "no chat tokens" in err and "add-chat-tokens" in err


def test_oldest_turns_leave_the_prompt_when_the_context_is_full(session_model: LoadedModel) -> None:
    session = ChatSession(session_model, ReplySettings(temperature=0, max_tokens=8), system="Hi.")
    written = io.StringIO()
    long = "Once upon a time there was a cat. " * 3  # about 30 tokens a message
    for _ in range(5):
        session.reply(long, written.write)
    assert len(session.turns) == 10  # the conversation keeps every turn ...
    ids, budget = session.prompt_ids([*session.turns, {"role": "user", "content": long}])
    assert len(ids) + budget <= session_model.model.cfg.block_size  # ... the prompt fits
    text = session.tok.decode(ids)
    assert text.startswith("<|system|>Hi.<|end|>") and text.endswith("<|assistant|>")
    with pytest.raises(KilnError, match="too long for the model's context"):
        session.reply("word " * 200, written.write)
    assert len(session.turns) == 10  # a refused message leaves no trace


def test_run_chat_keeps_going_after_ctrl_c_at_the_prompt(session_model: LoadedModel) -> None:
    session = ChatSession(session_model, ReplySettings(temperature=0, max_tokens=4))
    inputs = iter(["/help", KeyboardInterrupt(), "Hi.", EOFError()])

    def read(prompt: str) -> str:
        item = next(inputs)
        if isinstance(item, BaseException):
            raise item
        return item

    out = io.StringIO()
    assert run_chat(session, read, out) == 0
    assert "/temperature X" in out.getvalue() and "Ctrl-D or /quit to leave" in out.getvalue()
    assert [t["role"] for t in session.turns] == ["user", "assistant"]


def test_a_stopped_reply_keeps_what_was_written(
    session_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.posttrain.replies import ReplyGenerator

    def two_then_ctrl_c(*args: object) -> Iterator[int]:
        yield from session_model.tokenizer.encode("Once upon")  # type: ignore[union-attr]
        raise KeyboardInterrupt

    monkeypatch.setattr(ReplyGenerator, "stream", two_then_ctrl_c)
    session = ChatSession(session_model, ReplySettings(temperature=0))
    out = io.StringIO()
    assert session.reply("Hi.", out.write) == "Once upon"
    assert out.getvalue() == "Once upon [stopped]"
    assert session.turns[-1] == {"role": "assistant", "content": "Once upon"}


def test_ctrl_c_while_the_engine_steps_stops_the_reply_and_the_next_works(
    session_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.serve.engine import Engine

    real_step = Engine.step
    calls = {"n": 0}

    def step_then_interrupt(self: Engine) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as if Ctrl-C landed mid-step
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step_then_interrupt)
    session = ChatSession(session_model, ReplySettings(temperature=0, max_tokens=6))
    out = io.StringIO()
    session.reply("Hi.", out.write)
    assert out.getvalue().endswith(" [stopped]")
    again = io.StringIO()
    session.reply("Hi.", again.write)  # a fresh engine: a whole reply, not an error
    assert "[stopped]" not in again.getvalue()
    assert [t["role"] for t in session.turns] == ["user", "assistant"] * 2
