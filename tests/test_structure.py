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


# DESIGN.md's layers, bottom to top. A module imports only its own layer and those below; a
# package's cli.py (and kiln/cli.py, commands.py, demo.py) is the command-line layer on top.
LAYERS = [
    {"errors", "io", "folders", "fault_points", "config", "hardware", "devices", "plotting"},
    {"tokenizer", "kernels"},
    {"chat", "data", "model", "quant", "image"},
    {"train"},
    {"loading"},
    {"serve"},
    {"posttrain"},
    {"eval", "scaling"},
]
CLI = {"cli", "commands", "demo", "__init__"}


def _layer(part: str) -> int:
    if part in CLI:
        return len(LAYERS)
    return next(i for i, names in enumerate(LAYERS) if part in names)


def _imported_parts(tree: ast.AST) -> set[str]:
    parts = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        parts |= {n.split(".")[1] for n in names if n.startswith("kiln.") and n.count(".") >= 1}
    return parts


def test_no_module_imports_a_layer_above_its_own() -> None:
    wrong = []
    for path in sorted(KILN.rglob("*.py")):
        rel = path.relative_to(KILN).parts
        top = rel[0].removesuffix(".py")
        if top in CLI or rel[-1] == "cli.py":
            continue  # the command-line layer may import anything
        own = _layer(top)
        for part in _imported_parts(ast.parse(path.read_text(encoding="utf-8"))):
            if part not in CLI and _layer(part) > own:
                wrong.append(f"{'/'.join(rel)} imports kiln.{part}")
            elif part in CLI and part != "__init__":
                wrong.append(f"{'/'.join(rel)} imports the command line (kiln.{part})")
    assert wrong == []


def test_the_chat_format_imports_only_the_tokenizer_and_the_base_modules() -> None:
    # Stricter than its layer: chat sits beside data and model but must not lean on them, so the
    # server, export and post-training can share it without pulling in torch.
    allowed = {"chat", "tokenizer", *LAYERS[0]}
    wrong = []
    for path in sorted((KILN / "chat").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        wrong += [f"chat/{path.name} imports kiln.{p}" for p in _imported_parts(tree) - allowed]
        modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        wrong += [f"chat/{path.name} imports {m}" for m in modules if m.split(".")[0] == "torch"]
    assert wrong == []
