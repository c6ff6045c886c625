"""The chat format for post-training: render conversations, read them from JSON lines.

The renderer is `kiln.tokenizer.chat` (one renderer for export, serving and training; see its
doc for the layout and the loss mask); this module re-exports it and reads conversation files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from kiln.errors import KilnError
from kiln.io import iter_json_lines
from kiln.tokenizer.chat import (
    JINJA_TEMPLATE,
    ROLES,
    ChatTemplate,
    RenderedChat,
    chat_template_of,
    check_conversation,
    render,
    render_text,
    require_chat_template,
)
from kiln.tokenizer.special import CHAT_TOKENS

__all__ = [
    "CHAT_TOKENS",
    "JINJA_TEMPLATE",
    "ROLES",
    "ChatTemplate",
    "RenderedChat",
    "chat_template_of",
    "check_conversation",
    "iter_conversations",
    "render",
    "render_text",
    "require_chat_template",
]


def iter_conversations(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Each line of a JSON-lines file of conversations (`{"messages": [...], ...}`), checked.

    A bad line is one KilnError naming the file, the line number and the message at fault.
    """
    for where, record in iter_json_lines(path):
        if not isinstance(record, dict) or "messages" not in record:
            raise KilnError(f"{where}: expected an object with a 'messages' list")
        check_conversation(record["messages"], where)
        yield record
