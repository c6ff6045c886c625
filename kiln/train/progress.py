"""What a run shows on the console: the progress bar (rank 0 only) and lines that do not break it."""

from __future__ import annotations

from typing import Any

from kiln.train.config import TrainConfig
from kiln.train.distributed import DistInfo


def tqdm_write(line: str) -> None:
    """Print a line without breaking a progress bar."""
    from tqdm import tqdm

    tqdm.write(line)


def silent(*args: Any, **kwargs: Any) -> None:
    """print's stand-in on ranks other than the main one."""


def progress_bar(cfg: TrainConfig, step: int, total: int, dist: DistInfo) -> Any:
    """A tqdm bar over the steps (with loss, tokens/s, MFU and its own ETA), or None."""
    if not (cfg.logging.progress and dist.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=step, unit="step", dynamic_ncols=True)


def show_record(bar: Any, record: dict[str, Any]) -> None:
    """A metrics record's loss, tokens/s, MFU and val loss on the bar."""
    shown = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    if record["mfu"] is not None:
        shown["mfu"] = f"{100 * record['mfu']:.1f}%"
    if "val_loss" in record:
        shown["val"] = f"{record['val_loss']:.4f}"
    bar.set_postfix(shown, refresh=False)


def set_total(bar: Any, total: int) -> None:
    """A re-planned run's length on the bar."""
    if bar is not None and bar.total != total:
        bar.total = total
        bar.refresh()
