"""Structural rules a reader relies on: one definition for shared names."""

from __future__ import annotations

import ast
from pathlib import Path

import kiln
from kiln.tokenizer.special import EOT

KILN = Path(kiln.__file__).parent


def test_end_of_text_token_is_written_out_in_one_module_only() -> None:
    holders = []
    for path in sorted(KILN.rglob("*.py")):
        name = path.relative_to(KILN).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        literals = [
            node for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value == EOT
        ]
        if literals:
            holders.append(name)
    assert holders == ["tokenizer/special.py"]
