"""Extract: article text kept, boilerplate dropped, non-HTML untouched, offline, stateless."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from kiln.data.pipeline.document import Document
from kiln.data.pipeline.read.extract import Extract, ExtractConfig

ARTICLE = (
    "The river Kiln flows for two hundred kilometres through the valley before it reaches "
    "the sea. Farmers along its banks have grown barley and rye for centuries, and several "
    "of the old water mills still stand beside the weirs."
)
SECOND = (
    "In spring the meltwater raises the river by almost two metres, which is why the "
    "villages were built on the terraces above the flood plain rather than beside it."
)
PAGE = f"""<!DOCTYPE html>
<html><head><title>River Kiln | Travel Site</title></head><body>
<nav><ul><li><a href="/">Home</a></li><li><a href="/about">About us</a></li>
<li><a href="/contact">Contact</a></li></ul></nav>
<aside class="sidebar"><h3>Popular posts</h3><ul><li><a href="/a">Ten best beaches</a></li>
<li><a href="/b">Cheap flights to anywhere</a></li></ul></aside>
<main><article><h1>The river Kiln</h1><p>{ARTICLE}</p><p>{SECOND}</p></article></main>
<footer><p>Copyright 2024 Travel Site. All rights reserved.</p>
<p><a href="/privacy">Privacy policy</a> | <a href="/cookies">Cookie settings</a></p></footer>
</body></html>"""


@pytest.fixture(scope="module")
def stage() -> Extract:
    return Extract(ExtractConfig())


def html_doc(html: str, **meta) -> Document:
    return Document("d", html, "s", {"file": "f", "content_type": "html", **meta})


def test_article_kept_and_boilerplate_dropped(stage: Extract) -> None:
    doc = html_doc(PAGE, url="https://travel.example/kiln")
    assert stage.apply(doc) is None
    assert ARTICLE in doc.text and SECOND in doc.text
    for boilerplate in ("Home", "About us", "Popular posts", "Cheap flights", "Copyright",
                        "Privacy policy", "Cookie", "<p>"):  # fmt: skip
        assert boilerplate not in doc.text
    assert doc.meta["url"] == "https://travel.example/kiln"
    assert doc.meta["content_type"] == "text"


def test_non_html_documents_pass_untouched(stage: Extract) -> None:
    text = "<p>plain text that merely looks like markup</p>"
    doc = Document("d", text, "s", {"file": "f"})
    assert stage.apply(doc) is None
    assert doc.text == text and doc.meta == {"file": "f"}


def test_page_without_main_text_is_removed(stage: Extract) -> None:
    empty = "<html><head><script>var x = 1;</script></head><body><div> </div></body></html>"
    assert stage.apply(html_doc(empty)) == "extract.no_text"


def test_repeated_page_gives_the_same_text(stage: Extract) -> None:
    # trafilatura's deduplication cache is process-wide (a paragraph seen 3 times is dropped);
    # the stage must not let earlier documents change a later one's result.
    docs = [html_doc(PAGE) for _ in range(5)]
    for doc in docs:
        assert stage.apply(doc) is None
    assert len({d.text for d in docs}) == 1 and ARTICLE in docs[-1].text


def test_extraction_never_touches_the_network(monkeypatch, stage: Extract) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    doc = html_doc(PAGE, url="https://travel.example/kiln")
    assert stage.apply(doc) is None and ARTICLE in doc.text


def test_stage_pickles_as_its_config(stage: Extract) -> None:
    import pickle

    again = pickle.loads(pickle.dumps(stage))
    assert again.config == stage.config
    first, second = html_doc(PAGE), html_doc(PAGE)
    stage.apply(first)
    again.apply(second)
    assert first.text == second.text


def _slow_on_marker(real):
    """An extractor that hangs (in Python code, as trafilatura's loops do) on a marked page."""

    def extract(html: str, **kwargs):
        if "PATHOLOGICAL" in html:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                sum(range(1000))
        return real(html, **kwargs)

    return extract


def test_a_page_over_the_time_limit_is_removed_and_the_limit_is_released() -> None:
    stage = Extract(ExtractConfig(timeout_s=0.2))
    stage._extract = _slow_on_marker(stage._extract)
    started = time.monotonic()
    assert (
        stage.apply(html_doc(PAGE.replace("</main>", "PATHOLOGICAL</main>"))) == "extract.timeout"
    )
    assert time.monotonic() - started < 30  # not the 60 s the page would take
    assert stage.apply(html_doc(PAGE)) is None and ARTICLE in PAGE
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_pipeline_skips_and_logs_a_pathological_page(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trafilatura

    from kiln.data.pipeline.config import load_pipeline_config
    from kiln.data.pipeline.records import read_records
    from kiln.data.pipeline.runner import RunOptions, run_pipeline

    monkeypatch.setattr(trafilatura, "extract", _slow_on_marker(trafilatura.extract))
    (tmp_path / "pages").mkdir()
    for i in range(3):
        marker = "PATHOLOGICAL" if i == 1 else ""
        page = PAGE.replace("</main>", f"{marker}</main>").replace("Kiln", f"Kiln{i}")
        (tmp_path / "pages" / f"p{i}.html").write_text(page, encoding="utf-8")
    (tmp_path / "p.toml").write_text(
        f"""
[[sources]]
name = "pages"
paths = ["pages/*.html"]
[extract]
timeout_s = 0.3
[quality.gopher_quality]
enabled = false
[quality.c4]
enabled = false
[quality.fineweb]
enabled = false
[dedup.near]
enabled = false  # the three pages are near duplicates of each other
[split]
val_fraction = 0.0
[tokenize]
tokenizer = "{shared_data}/gpt2/vocab.json"
""",
        encoding="utf-8",
    )
    out = tmp_path / "out"
    run_pipeline(
        load_pipeline_config(tmp_path / "p.toml"), RunOptions(out=str(out), progress=False)
    )
    removed = list(read_records(out / "pipeline" / "removed.jsonl.zst"))
    assert [(Path(r["file"]).name, r["reason"]) for r in removed] == [
        ("p1.html", "extract.timeout")
    ]
    kept = {r["id"] for p in out.glob("train_*.docs.jsonl.zst") for r in read_records(p)}
    assert len(kept) == 2
