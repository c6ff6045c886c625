"""The serving package's boundaries: the HTTP server talks to the engine only."""

from __future__ import annotations

import ast
from pathlib import Path

import kiln

SERVE = Path(kiln.__file__).parent / "serve"
# What kiln.serve.http may import from kiln: the engine's public package (not its modules), the
# chat renderer, the tokenizer's user-text policy, the shared basics, and the image side's
# story-to-caption text rule (the image model itself is handed in loaded, like the engine).
HTTP_MAY_IMPORT = {"kiln.errors", "kiln.config", "kiln.serve.engine", "kiln.image.story_scene"}
HTTP_MAY_IMPORT_UNDER = ("kiln.serve.http.", "kiln.tokenizer.", "kiln.chat.")


def _kiln_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return {m for m in modules if m == "kiln" or m.startswith("kiln.")}


def test_the_http_server_reaches_the_model_only_through_the_engine_package() -> None:
    wrong = [
        f"{path.relative_to(SERVE).as_posix()} imports {module}"
        for path in sorted((SERVE / "http").rglob("*.py"))
        for module in sorted(_kiln_imports(path))
        if module not in HTTP_MAY_IMPORT and not module.startswith(HTTP_MAY_IMPORT_UNDER)
    ]
    assert wrong == []


def test_the_engine_does_not_import_the_http_server() -> None:
    wrong = [
        f"{path.relative_to(SERVE).as_posix()} imports {module}"
        for path in sorted((SERVE / "engine").rglob("*.py"))
        for module in sorted(_kiln_imports(path))
        if module.startswith(("kiln.serve.http", "kiln.serve.cli"))
    ]
    assert wrong == []
