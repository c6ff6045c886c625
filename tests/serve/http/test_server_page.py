"""The Storyteller page in a real headless browser (Debian's chromium + chromium-driver, driven by
selenium) against a real server: load it, type a prompt, watch tokens stream in, stop, continue,
look inside (token colours, probabilities on hover), illustrate, and keep the story in history.
Screenshots go to the test's temp folder. Plus the page's shipping rules: packaged, no network.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest
import torch

from kiln.serve.http.server import PAGE_POLICY, page_html
from tests.serve.http.conftest import RunningServer, serve_model

SHOTS_ENV = "KILN_TEST_SHOTS"  # a folder that also gets the illustrated page's screenshot (docs)
IMAGE_STEP_S = 0.25  # each denoising step waits this long, so the previews can be watched

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
STEP_DELAY_S = 0.01  # slows the engine so a person (and this test) can watch the story grow
WAIT_S = 30.0


def test_the_page_is_shipped_in_the_package_and_fetches_nothing_from_the_network(
    base_server: RunningServer,
) -> None:
    page = httpx.get(base_server.url + "/", timeout=WAIT_S)
    assert page.status_code == 200 and page.text == page_html()
    assert page.headers["content-security-policy"] == PAGE_POLICY
    assert "connect-src 'self'" in PAGE_POLICY and "default-src 'none'" in PAGE_POLICY
    # No address outside the server: the only absolute URL is the SVG namespace name.
    urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"'`]*", page.text))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=\"(?!data:)", page.text)


def _browser(tmp_path: Path) -> Any:
    """A headless chromium driven by selenium; skipped, naming the packages, where missing."""
    missing = [p for p, path in (("chromium", CHROMIUM), ("chromium-driver", CHROMEDRIVER))
               if shutil.which(path) is None]  # fmt: skip
    if missing:
        pytest.skip(
            f"the page test needs Debian's {' and '.join(missing)} (apt install {' '.join(missing)})"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="the page test needs selenium")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'profile'}"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    driver = _browser(tmp_path)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


@contextmanager
def watchable(model: Path) -> Iterator[RunningServer]:
    """`model` served by an engine that sleeps a little each step and, since a random model
    ends its text at a random end-of-text token, runs every request to its length."""
    with serve_model(model) as server:
        engine = server.engine
        step, submit = engine.step, engine.submit

        def slow_step() -> int:
            time.sleep(STEP_DELAY_S)
            return step()

        def submit_to_length(ids: list[int], params: Any) -> Any:
            return submit(ids, replace(params, ignore_eos=True))

        engine.step, engine.submit = slow_step, submit_to_length
        yield server


@pytest.fixture
def slow_server(base_model: Path) -> Iterator[RunningServer]:
    with watchable(base_model) as server:
        yield server


def wait_for(driver: Any, check: Any, what: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.02).until(lambda d: check(d), what)


def story_text(driver: Any) -> str:
    return driver.find_element("id", "story").text


def test_write_watch_it_stream_stop_continue_and_look_inside(
    browser: Any, slow_server: RunningServer, tmp_path: Path
) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    d = browser
    d.get(slow_server.url + "/")
    wait_for(d, lambda d: "model tiny" in d.find_element("id", "model").text, "the model line")
    assert "no chat template" in d.find_element("id", "model").text
    assert d.find_element("id", "change").get_attribute("disabled") is not None
    # Long enough to watch: the length slider at its maximum.
    d.execute_script(
        "const s = document.getElementById('length'); s.value = s.max;"
        "s.dispatchEvent(new Event('input'));"
    )
    prompt = d.find_element("id", "prompt")
    prompt.send_keys("Once upon a time, there was a little dog")
    d.find_element("id", "write").click()

    # Tokens stream in: the story grows over several looks while Stop is enabled.
    stop = d.find_element("id", "stop")
    wait_for(d, lambda d: stop.is_enabled(), "generation to start")
    start = len(story_text(d))
    seen = {start}
    wait_for(d, lambda d: seen.add(len(story_text(d))) or len(seen) >= 4, "the story to grow")
    assert stop.is_enabled() and max(seen) > start
    d.save_screenshot(str(tmp_path / "1-streaming.png"))
    stop.click()
    wait_for(d, lambda d: "Stopped" in d.find_element("id", "status").text, "the stop")
    stopped_at = story_text(d)
    assert not stop.is_enabled()
    wait_for(d, lambda d: slow_server.engine.stats().running == 0, "the request to be cancelled")
    d.save_screenshot(str(tmp_path / "2-stopped.png"))

    # Continue: the same story grows from where it stopped.
    d.find_element("id", "continue").click()
    wait_for(d, lambda d: len(story_text(d)) > len(stopped_at) + 20, "the continuation")
    assert story_text(d).startswith(stopped_at.rstrip()[:40])
    d.find_element("id", "stop").click()
    wait_for(d, lambda d: not d.find_element("id", "stop").is_enabled(), "the second stop")

    # Look inside: coloured tokens, each with its probability and alternatives on hover.
    look = d.find_element("id", "look")
    look.click()
    assert look.get_attribute("aria-pressed") == "true"
    tokens = d.find_elements("css selector", "#tokens .tok:not(.prompt)")
    assert len(tokens) > 10
    colours = {t.value_of_css_property("background-color") for t in tokens[:8]}
    assert len(colours) > 1  # neighbouring tokens differ: boundaries are visible
    ActionChains(d).move_to_element(tokens[3]).perform()
    tip = d.find_element("id", "tip")
    wait_for(d, lambda d: tip.is_displayed(), "the token's tooltip")
    assert re.search(r"\d+\.\d%", tip.text) and len(tip.find_elements("css selector", "tr")) == 5
    d.save_screenshot(str(tmp_path / "3-look-inside.png"))

    # Illustrate, then history: the story survives a reload (localStorage).
    d.find_element("id", "illustrate").click()
    assert d.find_element("css selector", "#picture svg").is_displayed()
    assert "not by a model" in d.find_element("css selector", "#picture figcaption").text
    d.save_screenshot(str(tmp_path / "4-illustrated.png"))
    d.refresh()
    wait_for(d, lambda d: d.find_elements("css selector", "#history li button"), "the history")
    d.find_element("css selector", "#history li button").click()
    assert story_text(d).startswith(stopped_at.rstrip()[:40])
    for name in ("1-streaming", "2-stopped", "3-look-inside", "4-illustrated"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000


def test_a_chat_model_writes_and_rewrites_the_story_on_request(
    browser: Any, chat_model: Path, tmp_path: Path
) -> None:
    d = browser
    with watchable(chat_model) as server:
        d.get(server.url + "/")
        wait_for(d, lambda d: "chat template: yes" in d.find_element("id", "model").text, "model")
        d.execute_script(
            "const s = document.getElementById('length'); s.value = 40;"
            "s.dispatchEvent(new Event('input'));"
        )
        d.find_element("id", "words").send_keys("dog, ball")
        d.find_element("id", "write").click()
        status = d.find_element("id", "status")
        wait_for(d, lambda d: status.text.startswith("Done"), "the story")
        first = story_text(d)
        assert first and "dog" in d.find_element("id", "words-used").text
        change = d.find_element("id", "change")
        assert change.is_enabled()
        change.send_keys("make it happier")
        d.find_element("id", "apply").click()
        stop = d.find_element("id", "stop")
        wait_for(d, lambda d: not stop.is_enabled() and story_text(d) != first, "the change")
        assert status.text.startswith("Done"), status.text
        d.save_screenshot(str(tmp_path / "chat-change.png"))
        items = d.find_elements("css selector", "#history li")
        assert len(items) == 2 and "changed: make it happier" in items[0].text


class SlowImageModel:
    """The image model, each denoising step slowed so its preview can be watched arriving."""

    def __init__(self, model: Any) -> None:
        self.inner = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sample(self, prompts: list[str], seed: int, steps: Any = None, on_step: Any = None,
               guidance: Any = None) -> torch.Tensor:  # fmt: skip
        def step(i: int, pictures: torch.Tensor) -> None:
            time.sleep(IMAGE_STEP_S)
            if on_step is not None:
                on_step(i, pictures)

        return self.inner.sample(prompts, seed, steps, step, guidance)


def test_illustrate_draws_the_story_with_the_image_model_step_by_step(
    browser: Any, base_model: Path, image_run: Path, tmp_path: Path
) -> None:
    import os

    from kiln.image.sampler import load_image_model

    model = load_image_model(image_run)
    steps = model.diffusion.sample_steps
    with serve_model(base_model, image_model=SlowImageModel(model)) as server:
        d = browser
        d.get(server.url + "/")
        wait_for(d, lambda d: "pictures: pictures" in d.find_element("id", "model").text, "model")
        d.execute_script(
            "const s = document.getElementById('length'); s.value = 20;"
            "s.dispatchEvent(new Event('input'));"
        )
        d.find_element("id", "prompt").send_keys(
            "Once upon a time, a little dog found a big red ball under a tree."
        )
        d.find_element("id", "write").click()
        status = d.find_element("id", "status")
        wait_for(d, lambda d: status.text.startswith("Done"), "the story")
        d.find_element("id", "illustrate").click()
        # The steps' pictures arrive one by one, each shown as it comes.
        counts: set[int] = set()

        def shown(d: Any) -> bool:
            counts.add(len(d.find_elements("css selector", "#steps img")))
            return "Drawn by" in d.find_element("id", "drawn-by").text

        wait_for(d, shown, "the finished picture")
        assert len(counts - {0, steps}) >= 2, counts  # seen part-way, more than once
        thumbs = d.find_elements("css selector", "#steps img")
        assert [t.get_attribute("data-step") for t in thumbs] == [str(i + 1) for i in range(steps)]
        drawn = d.find_element("id", "drawn")
        assert drawn.get_attribute("src").startswith("data:image/png;base64,")
        assert drawn.get_attribute("naturalWidth") == str(model.size)
        caption = d.find_element("id", "drawn-by").text
        assert "image model pictures" in caption
        assert "“a big red ball under a green tree”" in caption, caption
        assert "dog, ball, tree" in caption
        assert not d.find_elements("css selector", "#picture svg")  # not the composer
        d.save_screenshot(str(tmp_path / "illustrated-by-model.png"))
        assert (tmp_path / "illustrated-by-model.png").stat().st_size > 10_000
        if os.environ.get(SHOTS_ENV):
            d.save_screenshot(str(Path(os.environ[SHOTS_ENV]) / "storyteller-illustrate.png"))
