"""Access to the compiled extension; the package falls back to the reference path without it."""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType


def load_native() -> ModuleType | None:
    """The `_native` extension module, or None (with one warning) if it is missing or disabled."""
    if os.environ.get("KILN_NO_NATIVE") == "1":
        return None
    try:
        native = importlib.import_module("kiln.tokenizer._native")
    except ImportError as exc:
        warnings.warn(
            f"kiln's native tokenizer extension is not available ({exc}); using the pure-Python "
            "reference path, which is much slower. Reinstall with a C++17 compiler to build it.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return native


NATIVE = load_native()
