"""Extract: the main text of HTML documents (trafilatura), dropping navigation and boilerplate.

Only documents whose `meta["content_type"]` is `"html"` (HTML files and WARC responses) are
touched; everything else passes through unchanged. The defaults follow FineWeb, which ran
trafilatura through datatrove with `favour_precision=True`, `include_comments=False` and
`deduplicate=True`. trafilatura's `extract` only parses the string it is given; nothing here
downloads anything (the URL is passed for metadata only, and tested with sockets disabled).

Each page gets `timeout_s` seconds (a SIGALRM timer in the worker's main thread): a pathological
page is removed as `extract.timeout` and logged like any removal, instead of hanging its worker.
The timer interrupts Python code only, so a single C call of lxml finishes before it fires; off
the main thread (where signals cannot be delivered) pages run without a limit.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kiln.data.pipeline.document import Document


@dataclass(frozen=True)
class ExtractConfig:
    """trafilatura options for main-text extraction; the defaults are FineWeb's."""

    enabled: bool = True
    # FineWeb: Trafilatura(favour_precision=True): less text, but less boilerplate.
    favor_precision: bool = True
    favor_recall: bool = False
    # trafilatura's default, kept by FineWeb: table cells often hold real content.
    include_tables: bool = True
    include_comments: bool = False  # FineWeb: user comments are not the page's text
    include_links: bool = False
    include_formatting: bool = False
    # Drop segments repeated more than twice. trafilatura keeps that memory in a process-wide
    # cache, so results would depend on which documents a worker saw before; kiln gives every
    # document a fresh cache, which keeps the within-page dedup and makes the stage stateless.
    deduplicate: bool = True
    # trafilatura's own default is 250 characters; below it, trafilatura tries fallbacks.
    min_extracted_size: int = 250
    # Skip trafilatura's fallback extractors (readability, jusText): faster, a little less text.
    fast: bool = False
    # Seconds one page may take (0: no limit); a page over it is removed as `extract.timeout`.
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.timeout_s < 0:
            from kiln.config import ConfigError

            raise ConfigError(f"extract.timeout_s: expected >= 0, got {self.timeout_s}")


class ExtractTimeout(Exception):
    """A page took longer than `ExtractConfig.timeout_s`."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ExtractTimeout in the block after `seconds` (main thread only; 0: no limit)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise ExtractTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Extract:
    """Replace an HTML document's text by its extracted main text (plain text, paragraphs)."""

    name = "extract"

    def __init__(self, config: ExtractConfig) -> None:
        import trafilatura  # imported here so readers of plain text never pay for lxml
        from trafilatura.settings import use_config

        self.config = config
        self._extract: Callable[..., str | None] = trafilatura.extract
        settings = use_config()
        settings.set("DEFAULT", "MIN_EXTRACTED_SIZE", str(config.min_extracted_size))
        self._settings = settings

    def __reduce__(self) -> tuple[type, tuple[ExtractConfig]]:
        return (Extract, (self.config,))  # rebuilt from the config in the receiving process

    def apply(self, doc: Document) -> str | None:
        """Extract the main text of HTML documents; others pass; no text -> removed."""
        if doc.meta.get("content_type") != "html":
            return None
        from trafilatura.deduplication import LRUCache

        cfg = self.config
        try:
            with time_limit(cfg.timeout_s):
                text = self._extract(
                    doc.text,
                    url=doc.meta.get("url") or None,
                    fast=cfg.fast,
                    favor_precision=cfg.favor_precision,
                    favor_recall=cfg.favor_recall,
                    include_comments=cfg.include_comments,
                    include_tables=cfg.include_tables,
                    include_links=cfg.include_links,
                    include_formatting=cfg.include_formatting,
                    include_images=False,
                    deduplicate=LRUCache(maxsize=1024) if cfg.deduplicate else False,
                    with_metadata=False,
                    output_format="txt",
                    config=self._settings,
                )
        except ExtractTimeout:
            return "extract.timeout"
        except Exception:  # a page trafilatura/lxml cannot parse is a bad record, not a crash
            return "extract.error"
        if not text or not text.strip():
            return "extract.no_text"
        doc.text = text
        doc.meta["content_type"] = "text"  # extracted: running the stage again is a no-op
        return None
