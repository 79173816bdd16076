"""The dashboard in a real browser (Debian Chromium, Selenium) against ``kvledger serve``.

One server with ``--api-key`` and a small pool (0.02 GiB = 29 blocks of 737,280 bytes for the
bundled model in fp32), so one request visibly moves the KV usage. The page must show the login
state and no data without the key, then update live while a request generates, and show its
blocks cached or free once it finished; it must log no console error and contact no other host.
"""

from __future__ import annotations

import re
import threading

import httpx
import pytest
from browser import console_errors, missing_browser, requested_urls, served, start_chrome

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(missing_browser() is not None, reason=str(missing_browser()))]

KEY = "browser-key"
SECRET_PROMPT = "Zanzibar quokka marmalade lighthouse " * 6  # must never reach the page
# run before the page's scripts: every uPlot chart the page makes is kept in window.__charts
RECORD_CHARTS = """
(() => {
  const made = window.__charts = [];
  let chartClass;
  Object.defineProperty(window, "uPlot", { configurable: true, get: () => chartClass,
    set: (cls) => { chartClass = new Proxy(cls, { construct(target, args) {
      const chart = Reflect.construct(target, args); made.push(chart); return chart; } }); } });
})();
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = served(tmp_path_factory.mktemp("dash") / "serve.log", "--api-key", KEY,
                     "--kv-cache-gib", "0.02", "--log-interval-s", "1", "--dtype", "fp32")
    yield process
    process.close()


@pytest.fixture(scope="module")
def driver():
    chrome = start_chrome()
    yield chrome
    chrome.quit()


def wait(driver, condition, timeout_s=120.0, message=""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(
        lambda d: condition(d), message)


def text(driver, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text


def visible(driver, element_id: str) -> bool:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).is_displayed()


def log_in(driver, key: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, "login-key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#login-form button").click()


def test_without_the_key_the_page_shows_the_login_state(server, driver):
    driver.get(server.url + "/dashboard?interval_ms=200")
    wait(driver, lambda d: visible(d, "login"), 10)
    assert not visible(driver, "content")
    assert text(driver, "model") == ""  # no data was fetched
    assert not any("/dashboard/api" in u for u in requested_urls(driver))
    log_in(driver, "wrong-key")
    wait(driver, lambda d: visible(d, "login") and "refused" in text(d, "login-error"), 10)
    assert not visible(driver, "content")
    console_errors(driver)  # the refused key's 401 is the one expected error


def test_live_updates_while_generating_then_blocks_cached(server, driver):
    from selenium.webdriver.common.by import By

    driver.get(server.url + "/dashboard?interval_ms=200")
    wait(driver, lambda d: visible(d, "login"), 10)
    log_in(driver, KEY)
    wait(driver, lambda d: text(d, "status").startswith("live"), 20, "no live data")
    assert text(driver, "model") == "SmolLM2-135M-Instruct.Q4_1"
    idle_usage = text(driver, "kv-usage")

    result = {}

    def generate():
        result["response"] = httpx.post(
            server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
            json={"prompt": SECRET_PROMPT, "max_tokens": 150, "temperature": 0,
                  "ignore_eos": True}, timeout=600)

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        # the table is rebuilt on every poll: read it in one script call, never hold elements
        row = "#requests tr[data-request-id]"
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, row), 120, "no running row")
        request_id = driver.execute_script(
            f"return document.querySelector('{row}').dataset.requestId")
        assert request_id.startswith("cmpl-")
        start_usage = text(driver, "kv-usage")

        def output_tokens(d):
            return d.execute_script(
                "const r = document.querySelector(`tr[data-request-id='${arguments[0]}']`);"
                "return r ? Number(r.querySelector('.output').textContent) : null;", request_id)

        seen = output_tokens(driver)
        wait(driver, lambda d: (output_tokens(d) or 0) > (seen or 0) + 5, 120,
             "the running row did not advance")
        wait(driver, lambda d: text(d, "kv-usage") != start_usage, 120,
             "KV usage did not change while generating")
        assert start_usage != idle_usage
        assert SECRET_PROMPT.split()[0] not in driver.page_source
    finally:
        worker.join()
    assert result["response"].status_code == 200

    wait(driver, lambda d: not d.find_elements(By.CSS_SELECTOR, row), 30, "row stayed")
    wait(driver, lambda d: text(d, "legend-in-use") == "0", 30, "blocks still in use")
    # prompt (~60 tokens) + 149 tokens with KV: at least 12 full 16-token blocks stay cached
    assert int(text(driver, "legend-cached")) >= 12
    assert int(text(driver, "legend-free")) + int(text(driver, "legend-cached")) == 29
    wait(driver, lambda d: "1 samples" in text(d, "tpot-hint"), 30, "no TPOT sample")
    assert console_errors(driver) == []
    urls = requested_urls(driver)
    assert urls and all(u.startswith((server.url, "data:")) for u in urls), urls


def test_one_sample_time_axes_show_its_time(server, driver):
    """One poll in ten minutes: the charts hold one sample, and their time axis must span a
    moment around it (uPlot's own padding of a zero-width range spanned years)."""
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_CHARTS})
    driver.get(server.url + "/dashboard?interval_ms=600000")
    wait(driver, lambda d: visible(d, "login") or text(d, "status").startswith("live"), 20)
    if visible(driver, "login"):
        log_in(driver, KEY)
    wait(driver, lambda d: text(d, "status").startswith("live"), 20, "no live data")
    charts = driver.execute_script(
        "return window.__charts.filter((u) => u.scales.x.time).map((u) => ({"
        "samples: u.data[0], lo: u.scales.x.min, hi: u.scales.x.max,"
        "labels: u.axes[0]._values, year: new Date(u.data[0][0] * 1000).getFullYear()}))")
    assert len(charts) == 2  # KV usage, allocated vs ledger
    for chart in charts:
        (sample,) = chart["samples"]
        assert chart["lo"] <= sample <= chart["hi"]
        assert chart["hi"] - chart["lo"] <= 600, chart  # seconds, not years
        years = {int(y) for label in chart["labels"] for y in re.findall(r"\b2\d{3}\b", label)}
        assert years <= {chart["year"]}, chart["labels"]
    assert console_errors(driver) == []


def test_stats_never_carry_prompt_text(server):
    snap = httpx.get(server.url + "/dashboard/api/stats",
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    assert "Zanzibar" not in snap and "quokka" not in snap


def test_plan_form(server, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(server.url + "/dashboard/plan")  # same tab: the key is remembered
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#f-model option"), 30)
    Select(driver.find_element(By.ID, "f-model")).select_by_value("google/gemma-2-9b")
    Select(driver.find_element(By.ID, "f-kv")).select_by_value("fp8")
    driver.find_element(By.CSS_SELECTOR, "#plan-form button").click()
    wait(driver, lambda d: visible(d, "plan-out"), 60, "no plan shown")
    kinds = text(driver, "t-kinds")
    # Gemma 2 9B, fp8: 8 KV heads x 256 x 2 (K, V) x 1 B = 4.0 KiB a layer, + 2 fp32 scales per block of 16
    # tokens and KV head = 4 B a token: x 21 layers = 86,100 B = 84.1 KiB
    assert "sliding_attention 21 4.0 KiB 84.1 KiB 4096" in kinds
    assert driver.find_element(By.ID, "plot").get_attribute("src").startswith(
        "data:image/png;base64,")
    assert console_errors(driver) == []
