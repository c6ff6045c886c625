"""A URL/domain blocklist: remove documents whose source URL a blocklist file names.

As datatrove's URLFilter and the UT1 / RefinedWeb blocklists: a line naming a domain
(`example.com`) blocks it and every subdomain (`www.example.com`, `a.b.example.com`); a line
with a scheme (`https://example.org/page`) blocks that one URL (host lowercased, fragment and a
trailing slash ignored). Blank lines and lines starting with `#` are skipped. A document's URL
is `meta["url"]` (WARC records' target URI, or a jsonl record's `url` field); documents without
one are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kiln.data.pipeline.document import Document
from kiln.errors import KilnError


def normalise_url(url: str) -> tuple[str, str]:
    """(host, the URL as compared: scheme and host lowercased, no port, fragment or final /)."""
    parts = urlsplit(url.strip())
    host = (parts.hostname or "").rstrip(".").lower()
    path = parts.path.rstrip("/")
    query = f"?{parts.query}" if parts.query else ""
    return host, f"{parts.scheme.lower()}://{host}{path}{query}"


def read_blocklist(path: str) -> tuple[frozenset[str], frozenset[str]]:
    """(blocked domains, blocked URLs) of a blocklist file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise KilnError(f"url_blocklist.file = {path!r}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise KilnError(f"url_blocklist.file = {path!r}: not UTF-8 ({e.reason})") from None
    domains, urls = set(), set()
    for raw in lines:
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        if "://" in entry:
            urls.add(normalise_url(entry)[1])
        else:
            domains.add(entry.lower().rstrip(".").removeprefix("*."))
    if not domains and not urls:
        raise KilnError(f"url_blocklist.file = {path!r}: no domain or URL in it")
    return frozenset(domains), frozenset(urls)


@dataclass(frozen=True)
class UrlBlocklistConfig:
    """The blocklist file; off by default."""

    enabled: bool = False
    file: str = ""  # one domain or URL per line

    def __post_init__(self) -> None:
        if self.enabled and not self.file:
            raise KilnError(
                "[url_blocklist] file: give the blocklist file (a domain or URL a line)"
            )


class UrlBlocklist:
    """Removes a document whose URL or any parent domain of its host is listed."""

    name = "url_blocklist"

    def __init__(self, config: UrlBlocklistConfig) -> None:
        self.config = config
        self.domains, self.urls = read_blocklist(config.file)

    def apply(self, doc: Document) -> str | None:
        """Remove `doc` if its URL is blocked; the blocking entry goes to `meta["blocked_by"]`."""
        url = doc.meta.get("url")
        if not url:
            return None
        host, normal = normalise_url(url)
        if normal in self.urls:
            doc.meta["blocked_by"] = normal
            return "url_blocklist.url"
        labels = host.split(".")
        for i in range(len(labels)):
            domain = ".".join(labels[i:])
            if domain in self.domains:
                doc.meta["blocked_by"] = domain
                return "url_blocklist.domain"
        return None
