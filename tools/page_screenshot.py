"""Screenshot the Storyteller page over a real model, for the README (docs/images/storyteller.png).

    .venv/bin/python tools/page_screenshot.py runs/demo-20261201-110757 docs/images/storyteller.png

Starts `kiln serve MODEL --port 0`, opens the page in headless chromium, writes a story from a
prompt and required words (temperature 0.8, not seeded), illustrates it, opens "Look inside",
hovers one token and saves the window.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    """Serve, drive the page, save the PNG."""
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--prompt", default="Once upon a time, there was a little dog named Max.")
    p.add_argument("--words", default="dog, ball, park")
    args = p.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import WebDriverWait

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "serve", args.model, "--port", "0"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    url = next(m.group(1) for line in proc.stderr if (m := re.search(r"at (http://\S+?)/ ", line)))
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1500,1320",
    ):
        options.add_argument(flag)
    d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        d.get(url + "/")
        wait = WebDriverWait(d, 120, poll_frequency=0.1)
        wait.until(lambda d: "model " in d.find_element("id", "model").text)
        d.find_element("id", "prompt").send_keys(args.prompt)
        d.find_element("id", "words").send_keys(args.words)
        d.execute_script("const s = document.getElementById('length'); s.value = 120;"
                         "s.dispatchEvent(new Event('input'));")  # fmt: skip
        d.find_element("id", "write").click()
        wait.until(lambda d: d.find_element("id", "status").text.startswith("Done"))
        d.find_element("id", "illustrate").click()
        d.find_element("id", "look").click()
        tokens = d.find_elements("css selector", "#tokens .tok:not(.prompt)")
        ActionChains(d).move_to_element(tokens[min(6, len(tokens) - 1)]).perform()
        time.sleep(0.3)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        d.save_screenshot(args.out)
        print(f"saved {args.out}; story: {d.find_element('id', 'story').text[:200]!r}")
    finally:
        d.quit()
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
