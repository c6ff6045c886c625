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


# DESIGN.md's layers, bottom to top. A module imports only its own layer and those below. A
# package's cli.py counts with its package (no exemptions); only kiln/cli.py (the `kiln` entry
# point that registers every package's commands), demo.py, demo_chat.py and demo_image.py (the
# whole path in one command; the chat and image demos run the `kiln` commands themselves) sit on
# top of everything.
LAYERS = [
    {"errors", "io", "folders", "fault_points", "config", "hardware", "devices", "plotting",
     "commands", "__init__"},
    {"tokenizer", "kernels"},
    {"chat", "data", "model", "image", "quant"},
    {"checkpoint_format"},
    {"train"},
    {"loading"},
    {"serve"},
    {"posttrain"},
    {"eval", "scaling"},
    {"cli", "demo", "demo_chat", "demo_image"},
]  # fmt: skip


def _layer(part: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if part in names)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (type-only ties, allowed both ways)."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden |= {id(sub) for stmt in node.body for sub in ast.walk(stmt)}
    return hidden


def _imported_modules(tree: ast.AST) -> set[str]:
    """Every kiln module a file imports, at module level or inside functions (dotted names)."""
    hidden = _type_checking_only(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = {f"{node.module}.{alias.name}" for alias in node.names}
            names |= targets
            # `from kiln.pkg import module` loads only that module's file: the package's
            # __init__ counts when a name is taken from it.
            if not all(_is_module(t) for t in targets):
                names.add(node.module)
    return {n for n in names if n == "kiln" or n.startswith("kiln.")}


def _is_module(dotted: str) -> bool:
    """Whether `kiln.a.b` names a module file or package of kiln."""
    path = KILN.joinpath(*dotted.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module_files() -> dict[str, Path]:
    files = {}
    for path in KILN.rglob("*.py"):
        parts = ("kiln", *path.relative_to(KILN).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def test_no_module_imports_a_layer_above_its_own() -> None:
    wrong = set()
    for path in sorted(KILN.rglob("*.py")):
        rel = path.relative_to(KILN).parts
        own = _layer(rel[0].removesuffix(".py"))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for module in sorted(_imported_modules(tree)):
            if module == "kiln":
                continue
            part = module.split(".")[1]
            if not (KILN / part).is_dir() and not (KILN / f"{part}.py").is_file():
                part = "__init__"  # a name from kiln/__init__.py (`from kiln import __version__`)
            if _layer(part) > own:
                wrong.add(f"{'/'.join(rel)} imports kiln.{part}")
    assert sorted(wrong) == []


def test_no_two_files_import_each_other() -> None:
    files = _module_files()
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        imported = _imported_modules(ast.parse(path.read_text(encoding="utf-8")))
        edges[name] = {m for m in imported if m in files and m != name}
    pairs = sorted(
        f"{a} <-> {b}" for a, targets in edges.items() for b in targets if a < b and a in edges[b]
    )
    assert pairs == []


def test_the_chat_format_imports_only_the_tokenizer_and_the_base_modules() -> None:
    # Stricter than its layer: chat sits beside data and model but must not lean on them, so the
    # server, export and post-training can share it without pulling in torch.
    allowed = {"chat", "tokenizer", *LAYERS[0]}
    wrong = []
    for path in sorted((KILN / "chat").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parts = {m.split(".")[1] for m in _imported_modules(tree) if m != "kiln"}
        wrong += [f"chat/{path.name} imports kiln.{p}" for p in parts - allowed]
        modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        wrong += [f"chat/{path.name} imports {m}" for m in modules if m.split(".")[0] == "torch"]
    assert wrong == []
