"""Conversation files: JSON lines of `{"messages": [...], ...}`, each line checked as it is read."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from kiln.chat.render import check_conversation
from kiln.errors import KilnError
from kiln.io import iter_json_lines


def iter_conversations(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Each line of a JSON-lines file of conversations (`{"messages": [...], ...}`), checked.

    A bad line is one KilnError naming the file, the line number and the message at fault.
    """
    for where, record in iter_json_lines(path):
        if not isinstance(record, dict) or "messages" not in record:
            raise KilnError(f"{where}: expected an object with a 'messages' list")
        check_conversation(record["messages"], where)
        yield record
