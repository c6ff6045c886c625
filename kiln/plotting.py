"""matplotlib on the file-only Agg backend, and PNGs written atomically: every kiln figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.io import atomic_write


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or one clear error when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on training machines
        import matplotlib.pyplot as plt
    except ImportError:
        raise KilnError("plotting needs matplotlib: pip install 'kiln[plot]'") from None
    return plt


def save_png(fig: Any, path: str | Path, dpi: int | None = None) -> Path:
    """Write a figure as PNG atomically (temp file + rename) and close it."""
    out = Path(path)
    try:
        with atomic_write(out, "wb", encoding=None) as handle:
            fig.savefig(handle, format="png", dpi=dpi, bbox_inches="tight")
    finally:
        pyplot().close(fig)
    return out
