"""The chat page in a real headless browser (Debian's Chromium driven by Selenium): load it, send a
prompt, wait for the streamed answer and its statistics, and take a screenshot."""

import os
import pathlib
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        if os.environ.get("CI"):
            pytest.fail("Chromium and chromedriver are missing; .ci/run installs them (apt-get install chromium chromium-driver)")
        pytest.skip("needs Chromium and chromedriver: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-dev-shm-usage", "--window-size=1200,900"]:
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


@pytest.mark.parametrize("which", ["tiny", "pair"])
def test_the_chat_page_streams_an_answer_with_speculation_stats(which, request, tmp_path):
    server = request.getfixturevalue(f"{which}_server")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser()
    try:
        d.get(server.base + "/")
        wait = WebDriverWait(d, 300)
        # The model list fills the drafter menu.
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#drafter option")) >= 2)
        d.find_element(By.ID, "maxtokens").clear()
        d.find_element(By.ID, "maxtokens").send_keys("48")
        d.find_element(By.ID, "prompt").send_keys("Write a Python function that reverses a string.")
        d.find_element(By.ID, "send").click()
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, ".assistant[data-state='done']")))
        box = d.find_element(By.CSS_SELECTOR, ".assistant")
        stats = box.find_element(By.CSS_SELECTOR, ".stats").text
        answer = box.text.replace(stats, "").strip()
        assert answer, "no answer text"
        assert "tok/s" in stats and "acceptance" in stats, stats
        assert "error" not in box.get_attribute("data-state")
        if which == "pair":
            # The default pair drafts well on code: some text is tinted as drafted and accepted.
            assert d.find_elements(By.CSS_SELECTOR, ".assistant span.acc, .assistant span.mix")
        out = pathlib.Path(os.environ.get("SPECDEC_SCREENSHOT_DIR", tmp_path))
        out.mkdir(parents=True, exist_ok=True)
        shot = out / f"chat-page-{which}.png"
        d.save_screenshot(str(shot))
        assert shot.stat().st_size > 1000
        print("screenshot:", shot, "| stats:", stats)
    finally:
        d.quit()
