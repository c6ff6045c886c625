"""URL blocklist: a listed domain blocks itself and its subdomains only, a listed URL blocks
that URL however it is written, documents without a URL pass; bad files are one clear error."""

from __future__ import annotations

import pytest

from kiln.data.pipeline.document import Document
from kiln.data.pipeline.filter.url_blocklist import UrlBlocklist, UrlBlocklistConfig
from kiln.errors import KilnError


@pytest.fixture
def stage(tmp_path) -> UrlBlocklist:
    path = tmp_path / "block.txt"
    path.write_text(
        "# ad farms\nSpam.example\n*.tracker.net\n\nhttps://news.example.org/bad-story\n",
        encoding="utf-8",
    )
    return UrlBlocklist(UrlBlocklistConfig(enabled=True, file=str(path)))


def verdict(stage: UrlBlocklist, url: str | None) -> tuple[str | None, Document]:
    doc = Document("d", "text", "t", {} if url is None else {"url": url})
    return stage.apply(doc), doc


@pytest.mark.parametrize(
    "url",
    [
        "http://spam.example/",
        "https://www.spam.example/a?b=1",
        "http://A.B.SPAM.EXAMPLE:8080/x",
        "https://tracker.net/p",
        "https://cdn.tracker.net/p",
    ],
)
def test_listed_domains_and_their_subdomains_are_removed(stage, url):
    reason, doc = verdict(stage, url)
    assert reason == "url_blocklist.domain"
    assert doc.meta["blocked_by"] in {"spam.example", "tracker.net"}


@pytest.mark.parametrize(
    "url", ["https://notspam.example/", "https://spam.example.com/", "https://news.example.org/"]
)
def test_other_domains_pass(stage, url):
    assert verdict(stage, url)[0] is None


def test_a_listed_url_is_removed_however_written(stage):
    for url in (
        "https://news.example.org/bad-story",
        "HTTPS://News.Example.org/bad-story/",
        "https://news.example.org/bad-story#comments",
    ):
        assert verdict(stage, url)[0] == "url_blocklist.url"
    assert verdict(stage, "https://news.example.org/good-story")[0] is None


def test_documents_without_a_url_are_kept(stage):
    assert verdict(stage, None)[0] is None
    assert verdict(stage, "")[0] is None


def test_bad_blocklist_files_are_one_clear_error(tmp_path):
    with pytest.raises(KilnError, match=r"url_blocklist.file = .*nope.txt.*cannot read"):
        UrlBlocklist(UrlBlocklistConfig(enabled=True, file=str(tmp_path / "nope.txt")))
    empty = tmp_path / "empty.txt"
    empty.write_text("# only a comment\n", encoding="utf-8")
    with pytest.raises(KilnError, match="no domain or URL"):
        UrlBlocklist(UrlBlocklistConfig(enabled=True, file=str(empty)))
    with pytest.raises(KilnError, match=r"\[url_blocklist\] file"):
        UrlBlocklistConfig(enabled=True)
