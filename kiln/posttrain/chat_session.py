"""`kiln chat MODEL`: a multi-turn terminal conversation with a chat model, replies streamed.

A session keeps the conversation (an optional system message, then user/assistant turns),
renders it with the chat format for each reply and streams the reply's text as it decodes.
Commands: /reset, /system TEXT, /temperature X, /help, /quit. Ctrl-C during a reply stops that
reply (what was written stays in the conversation) and returns to the prompt; Ctrl-C at the
prompt only says how to leave (Ctrl-D or /quit). When the conversation no longer fits the
model's context, its oldest turns are left out of the prompt (the system message stays).

Replies come from `kiln.posttrain.replies.ReplyGenerator` (kiln.serve's engine).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TextIO

from kiln.chat import ChatTemplate, render, require_chat_template
from kiln.errors import KilnError
from kiln.loading import LoadedModel
from kiln.posttrain.replies import ReplyGenerator, ReplySettings, reply_stop_ids
from kiln.tokenizer.tokenizer import Tokenizer

HELP = """commands:
  /reset           forget the conversation (the system message stays)
  /system TEXT     set the system message (/system alone removes it)
  /temperature X   sampling temperature (0: greedy)
  /help            this list
  /quit            leave (or Ctrl-D); Ctrl-C stops a reply"""


def _text_of(tok: Tokenizer, ids: list[int]) -> str:
    """Text of ids, leaving out ids of a padded vocabulary that the tokenizer does not have."""
    return tok.decode([i for i in ids if i < tok.n_vocab])


@dataclass
class ChatSession:
    """One conversation with a loaded chat model."""

    loaded: LoadedModel
    settings: ReplySettings = field(default_factory=ReplySettings)
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)
    replies: int = 0  # replies made so far (varies a seeded sampler from reply to reply)

    def __post_init__(self) -> None:
        assert self.loaded.tokenizer is not None
        self.tok: Tokenizer = self.loaded.tokenizer
        self.template: ChatTemplate = require_chat_template(self.tok, "kiln chat")
        self.generator = ReplyGenerator(
            self.loaded, reply_stop_ids(self.loaded, self.template.stop_ids)
        )

    def messages(self) -> list[dict[str, str]]:
        """The conversation so far, system message first."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def prompt_ids(self, turns: list[dict[str, str]]) -> tuple[list[int], int]:
        """The prompt for the next reply and its token budget; oldest turns left out to fit."""
        block = self.loaded.model.cfg.block_size
        system = [{"role": "system", "content": self.system}] if self.system else []
        while True:
            ids = render(system + turns, self.tok, add_generation_prompt=True, where="chat").ids
            room = block - len(ids)
            if room >= min(self.settings.max_tokens, 16) or len(turns) <= 1:
                break
            turns = turns[2:] if len(turns) > 2 else turns[-1:]  # drop the oldest exchange
        if room < 1:
            raise KilnError(
                f"the message is too long for the model's context ({len(ids)} tokens of "
                f"{block}); send a shorter one or /reset"
            )
        return ids, min(room, self.settings.max_tokens)

    def reply(self, text: str, write: Callable[[str], None]) -> str:
        """Answer the user's `text`, writing the reply as it comes; the reply's text.

        KeyboardInterrupt (Ctrl-C) ends the reply early: the part written so far is kept.
        """
        turns = [*self.turns, {"role": "user", "content": text}]
        ids, budget = self.prompt_ids(turns)  # a refused message fails here, before any output
        settings = replace(self.settings, max_tokens=budget)
        if settings.seed is not None:
            settings = replace(settings, seed=settings.seed + self.replies)
        self.replies += 1
        new: list[int] = []
        shown = ""
        try:
            for token in self.generator.stream(ids, settings):
                new.append(token)
                shown = self._show(new, shown, write)
                _reply_token_hook()
        except KeyboardInterrupt:
            write(_text_of(self.tok, new)[len(shown) :] + " [stopped]")
            shown = _text_of(self.tok, new)
        else:
            write(_text_of(self.tok, new)[len(shown) :])
            shown = _text_of(self.tok, new)
        self.turns = [*turns, {"role": "assistant", "content": shown}]
        return shown

    def _show(self, new: list[int], shown: str, write: Callable[[str], None]) -> str:
        text = _text_of(self.tok, new)
        if text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            return shown
        write(text[len(shown) :])
        return text

    def command(self, line: str) -> str | None:
        """Run a /command; the line to print, or None to leave the chat."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return None
        if name == "/reset":
            self.turns = []
            return "(conversation reset)"
        if name == "/system":
            self.system = arg or None
            return f"(system message: {arg})" if arg else "(no system message)"
        if name == "/temperature":
            try:
                value = float(arg)
            except ValueError:
                raise KilnError(f"/temperature needs a number, got {arg!r}") from None
            self.settings = replace(self.settings, temperature=value)
            return f"(temperature {value:g})"
        if name == "/help":
            return HELP
        raise KilnError(f"unknown command {name!r}; /help lists them")


def run_chat(session: ChatSession, read: Callable[[str], str], out: TextIO = sys.stdout) -> int:
    """The read-reply loop: lines from `read` (input), replies to `out`, until EOF or /quit."""

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    while True:
        try:
            line = read("> ")
        except EOFError:
            write("\n")
            return 0
        except KeyboardInterrupt:
            write("\n(Ctrl-D or /quit to leave)\n")
            continue
        if not line.strip():
            continue
        try:
            if line.startswith("/"):
                said = session.command(line)
                if said is None:
                    return 0
                write(said + "\n")
                continue
            session.reply(line, write)
            write("\n")
        except KilnError as exc:
            write(f"error: {exc}\n")


def _reply_token_hook() -> None:
    """The tests' hook: pause after a reply token (KILN_TEST_WAIT_AT=chat:reply-token)."""
    from kiln.fault_points import wait_point

    wait_point("chat:reply-token")
