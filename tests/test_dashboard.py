"""The dashboard in a real browser (Debian's headless Chromium, driven by Selenium through
/usr/bin/chromedriver) against a real `trainyard serve` process over loopback, keys on,
training the demo model on the cpu backend: what a person sees.

Without chromedriver the module is skipped, except under CI (`CI` set), where it fails:
`.ci/run` installs it. Screenshots go under each test's tmp_path, and also into
$TRAINYARD_SCREENSHOTS when that is set (docs/screenshots/ was made that way)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.settings import Settings
from tests import factories as f
from tests.processes import PATIENCE, free_port, start_api, stop, wait_ready

CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM = Path("/usr/bin/chromium")
if not CHROMEDRIVER.exists():
    if os.environ.get("CI"):
        pytest.fail(f"{CHROMEDRIVER} is missing: .ci/run installs chromium-driver", pytrace=False)
    pytest.skip(
        f"{CHROMEDRIVER} is missing: apt-get install chromium chromium-driver",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import (  # noqa: E402
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.torch]  # the demo model trains on the cpu backend
KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WAIT = 120.0  # seconds for anything the page should show (a loaded machine: README)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, httpx.Client]]:
    """One `trainyard serve` for the module (with its worker and the demo model), keys on."""
    root = tmp_path_factory.mktemp("dashboard")
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{root / 'trainyard.db'}", data_dir=root / "data"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (root / "serve.log").open("wb") as output:
        process = start_api(
            settings, port, output=output, TRAINYARD_API_KEYS=KEY, TRAINYARD_DEMO_MODEL="true"
        )
        try:
            asyncio.run(wait_ready(url, [process]))
            with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
                _until(lambda: client.get("/v1/models/demo").json().get("inference_base_url"))
                yield url, client
        finally:
            stop(process)


@pytest.fixture(scope="module")
def browser(server: tuple[str, httpx.Client]) -> Iterator[webdriver.Chrome]:
    """Headless Chromium, closed before the server stops (its streams with it)."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    options.add_argument("--window-size=1280,900")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser: webdriver.Chrome, server: tuple[str, httpx.Client]) -> Iterator[Any]:
    """The browser, signed in, with its console checked after the test: no script error and
    no Content-Security-Policy violation."""
    url, _ = server
    browser.get(f"{url}/dashboard/")
    browser.execute_script("sessionStorage.setItem('trainyard.apiKey', arguments[0])", KEY)
    browser.get_log("browser")  # start from a clean console
    yield browser
    errors = [
        entry["message"]
        for entry in browser.get_log("browser")
        if entry["level"] == "SEVERE" and "status of 401" not in entry["message"]
    ]
    assert errors == []


def _until(condition: Any, timeout: float = WAIT, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


def wait(driver: webdriver.Chrome, condition: Any, what: str, timeout: float = WAIT) -> Any:
    # The page redraws a job's header as its events arrive: an element found a moment ago
    # may be gone, so a stale one is looked up again.
    waiting = WebDriverWait(
        driver, timeout, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException]
    )
    try:
        return waiting.until(lambda d: condition(d), message=what)
    except TimeoutException:
        # What the page showed, for the report: its text and its console.
        shown = driver.execute_script("return document.body.innerText")
        raise AssertionError(f"{what}: {shown[:2000]}\n{driver.get_log('browser')}") from None


def count(driver: webdriver.Chrome, css: str) -> int:
    return len(driver.find_elements(By.CSS_SELECTOR, css))


def text(driver: webdriver.Chrome, css: str) -> str:
    """The text of the first element `css` finds (read in one step: the page redraws)."""
    script = "const e = document.querySelector(arguments[0]); return e ? e.innerText : ''"
    return str(driver.execute_script(script, css))


def click(driver: webdriver.Chrome, css: str) -> bool:
    driver.find_element(By.CSS_SELECTOR, css).click()
    return True


def screenshot(
    driver: webdriver.Chrome, tmp_path: Path, name: str, size: tuple[int, int] = (1280, 900)
) -> None:
    """The page as a window of `size` shows it, saved under tmp_path (and
    $TRAINYARD_SCREENSHOTS)."""
    driver.set_window_size(*size)
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1280, 900)
    if target := os.environ.get("TRAINYARD_SCREENSHOTS"):
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)


def test_a_401_asks_for_the_key_and_then_the_lists_show(browser, server, tmp_path) -> None:
    url, _ = server
    browser.get(f"{url}/dashboard/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{url}/dashboard/#/models")
    field = wait(browser, lambda d: d.find_elements(By.ID, "api-key"), "the key form")[0]
    assert "API key" in browser.find_element(By.CSS_SELECTOR, ".key-form").text
    screenshot(browser, tmp_path, "key-form")
    field.send_keys("not-the-key")
    browser.find_element(By.CSS_SELECTOR, ".key-form button").click()
    wait(browser, lambda d: "refused" in text(d, ".key-form"), "the key refused")
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, ".key-form button").click()
    wait(browser, lambda d: count(d, "[data-model='demo']"), "the demo model's card")
    card = text(browser, "[data-model='demo']")
    screenshot(browser, tmp_path, "models")
    assert "Latest step" in card and "Checkpoints" in card
    assert KEY not in browser.current_url
    held = browser.execute_script("return sessionStorage.getItem('trainyard.apiKey')")
    assert held == KEY
    # A model's runs: its card links to the list filtered by it.
    wait(browser, lambda d: click(d, "[data-model='demo'] a[href='#/runs?model=demo']"), "Runs")
    wait(browser, lambda d: count(d, "[data-page='runs'] #rows tr"), "the demo model's runs")
    assert browser.find_element(By.ID, "filter-model").get_attribute("value") == "demo"
    screenshot(browser, tmp_path, "runs")
    # Another page, and a reload, use the same key without asking again.
    browser.get(f"{url}/dashboard/#/training-jobs?status=running")
    wait(browser, lambda d: count(d, "[data-page='training-jobs'] #rows tr"), "the list")
    select = browser.find_element(By.ID, "filter-status")
    assert select.get_attribute("value") == "running"
    assert count(browser, "#api-key") == 0 and KEY not in browser.current_url


# Put before the dashboard's scripts: every fetch waits until the test lets it go.
HOLD = """
window.held = [];
const real = window.fetch.bind(window);
window.fetch = (...args) => window.holding === false ? real(...args)
  : new Promise((resolve, reject) => window.held.push(() => real(...args).then(resolve, reject)));
window.release = () => { window.holding = false; window.held.splice(0).forEach((go) => go()); };
"""


def test_a_key_given_while_a_keyless_request_is_out_is_used_not_dropped(browser, server) -> None:
    """The page's first request goes out without a key; the key is given before its 401
    comes back. The 401 refused no key, so the page is drawn with the key given, not the key
    form with the key thrown away (seen as a test's key lost under load)."""
    url, _ = server
    browser.get(f"{url}/healthz")  # the service's origin, outside the dashboard
    browser.execute_script("sessionStorage.clear()")
    hold = browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": HOLD})
    try:
        browser.get(f"{url}/dashboard/#/models")
        wait(browser, lambda d: d.execute_script("return window.held.length"), "a request held")
        browser.execute_script("sessionStorage.setItem('trainyard.apiKey', arguments[0])", KEY)
        browser.execute_script("window.release()")
    finally:
        browser.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", hold)
    wait(browser, lambda d: count(d, "[data-model='demo']"), "the demo model's card")
    assert count(browser, "#api-key") == 0
    assert browser.execute_script("return sessionStorage.getItem('trainyard.apiKey')") == KEY


def run_body(max_steps: int) -> dict[str, Any]:
    """The toy task on the demo model: the reward is 1 when the one-token answer is a digit."""
    examples = [
        {
            "id": f"{split}-{i}",
            "messages": [{"role": "user", "content": f"say a number {i}"}],
            "expected": "7",
            "split": split,
        }
        for split, n in (("train", 4), ("validation", 2))
        for i in range(n)
    ]
    return {
        "model": "demo",
        "examples": examples,
        "recipe": {
            "num_generations": 4,
            "sampling": {"max_tokens": 1, "temperature": 1.0},
            "grader": {"type": "regex", "pattern": "^[0-9]$"},
        },
        "schedule": {"max_steps": max_steps, "examples_per_step": 2},
        "hyperparameters": {"learning_rate": 0.05},
        "validation": {"every_steps": 5, "num_generations": 4},
        "metadata": {"note": "<img src=x onerror=alert(1)>"},
    }


def test_a_run_page_gains_points_as_steps_land(page, server, tmp_path) -> None:
    url, client = server
    created = client.post("/v1/runs", json=run_body(10))
    assert created.status_code == 202, created.text
    run_id = created.json()["id"]
    # Held (the child under way finishes) until the page is open, so that it sees steps
    # land however fast they train.
    assert client.post(f"/v1/runs/{run_id}/pause").status_code == 200
    page.get(f"{url}/dashboard/#/runs/{run_id}")
    points = "[data-chart='reward'] [data-series='reward_mean'] circle.point"
    wait(page, lambda d: count(d, "[data-page='run'] #charts figure"), "the charts")
    before = count(page, points)
    assert before <= 1
    metadata = "[data-page='run'] details[data-key='Metadata']"
    page.find_element(By.CSS_SELECTOR, f"{metadata} summary").click()
    assert client.post(f"/v1/runs/{run_id}/resume").status_code == 200
    wait(page, lambda d: count(d, points) > before, "a point for a landed step")
    # The header is redrawn as events arrive; what a person opened stays open.
    assert count(page, f"{metadata}[open]") == 1
    wait(page, lambda d: "succeeded" in text(d, "h2 .badge"), "the run to end", timeout=PATIENCE)
    metrics = client.get(f"/v1/runs/{run_id}/metrics?limit=1000").json()["data"]
    steps = [m for m in metrics if m["kind"] == "step"]
    validations = [m for m in metrics if m["kind"] == "validation"]
    wait(page, lambda d: count(d, points) == len(steps), "a point per step")
    validation = "[data-chart='reward'] [data-series='validation'] circle.point"
    wait(page, lambda d: count(d, validation) == len(validations), "a point per validation")
    assert count(page, "[data-chart='loss']") == 1
    assert count(page, "[data-chart='reward'] polygon.band") == 1
    assert "step 10 of 10" in text(page, "[data-page='run'] .progress")
    # The metadata is shown as text, never run as markup.
    assert count(page, "img") == 0 and "onerror" in page.page_source
    screenshot(page, tmp_path, "run-page", size=(1280, 1500))
    # On a phone: one column, nothing wider than the screen.
    page.set_window_size(390, 844)
    wide = "return document.documentElement.scrollWidth - window.innerWidth"
    wait(page, lambda d: d.execute_script(wide) <= 0, "a page as narrow as a phone")
    screenshot(page, tmp_path, "run-page-phone", size=(390, 844))


def test_a_job_page_shows_its_events_live_and_a_cancel(page, server, tmp_path) -> None:
    url, client = server
    created = client.post("/v1/models", json=f.model_body("slow", seconds_per_step=60))
    assert created.status_code == 201, created.text
    job = client.post(
        "/v1/training-jobs", json={"model": "slow", "collection": f.nat_collection()}
    ).json()
    # From the list to the job's page, as a person would go.
    page.get(f"{url}/dashboard/#/training-jobs")
    wait(page, lambda d: click(d, f"#rows tr[data-id='{job['id']}'] a"), "the job's link")
    wait(page, lambda d: job["id"] in text(d, "[data-page='job'] h2"), "the job's page")
    types = "#events tr td:nth-child(3)"
    seen = lambda d: [e.text for e in d.find_elements(By.CSS_SELECTOR, types)]  # noqa: E731
    wait(page, lambda d: "training_started" in seen(d), "the job to start, live")
    assert seen(page)[0] == "job_queued"
    wait(page, lambda d: "running" in text(d, "h2 .badge"), "the job to show as running")
    screenshot(page, tmp_path, "job-page-running")
    wait(page, lambda d: click(d, "button[data-action='cancel']"), "a click on Cancel")
    wait(page, lambda d: "cancelled" in text(d, "h2 .badge"), "the job to show as cancelled")
    wait(page, lambda d: "job_cancelled" in seen(d), "the cancel in the event log")
    assert count(page, "button[data-action='cancel']") == 0
    assert client.get(f"/v1/training-jobs/{job['id']}").json()["status"] == "cancelled"
    screenshot(page, tmp_path, "job-page")
    # The list shows it too, under its status filter.
    page.get(f"{url}/dashboard/#/training-jobs?status=cancelled")
    wait(page, lambda d: count(d, f"#rows tr[data-id='{job['id']}']"), "the job in the list")


def test_a_job_page_says_what_a_waiting_job_waits_for(page, server) -> None:
    url, client = server
    body = f.model_body("far") | {"pool": "gpu", "labels": {"gpu": "h200"}}
    assert client.post("/v1/models", json=body).status_code == 201
    job = client.post("/v1/training-jobs", json={"model": "far", "collection": f.nat_collection()})
    page.get(f"{url}/dashboard/#/training-jobs/{job.json()['id']}")
    wait(page, lambda d: "queued" in text(d, "h2 .badge"), "the job's page")
    assert text(page, "#waiting-for") == "Waiting: no live worker in pool `gpu`"


def test_a_run_pauses_resumes_and_cancels_from_its_buttons(page, server) -> None:
    url, client = server
    created = client.post("/v1/runs", json=run_body(10_000))
    assert created.status_code == 202, created.text
    run_id = created.json()["id"]
    page.get(f"{url}/dashboard/#/runs/{run_id}")
    wait(page, lambda d: click(d, "button[data-action='pause']"), "a click on Pause")
    wait(page, lambda d: count(d, "button[data-action='resume']"), "a Resume button")
    assert "paused" in text(page, "[data-page='run'] h2")
    assert client.get(f"/v1/runs/{run_id}").json()["paused"] is True
    wait(page, lambda d: click(d, "button[data-action='resume']"), "a click on Resume")
    wait(page, lambda d: count(d, "button[data-action='pause']"), "a Pause button again")
    wait(page, lambda d: click(d, "button[data-action='cancel']"), "a click on Cancel")
    wait(page, lambda d: "cancelled" in text(d, "h2 .badge"), "the run to show as cancelled")
    assert count(page, "[data-page='run'] .actions button") == 0
    assert client.get(f"/v1/runs/{run_id}").json()["status"] == "cancelled"
    # Its child jobs, in the rollout jobs' list, link to their own pages and event logs.
    page.get(f"{url}/dashboard/#/rollout-jobs")
    wait(page, lambda d: click(d, "#rows tr a"), "a rollout job's link")
    wait(page, lambda d: count(d, "#events tr"), "the rollout job's event log")
    assert "job_queued" in text(page, "#events")


def test_a_list_follows_its_jobs_statuses(page, server) -> None:
    url, client = server
    if client.get("/v1/models/slow").status_code == 404:
        created = client.post("/v1/models", json=f.model_body("slow", seconds_per_step=60))
        assert created.status_code == 201, created.text
    job = client.post(
        "/v1/training-jobs", json={"model": "slow", "collection": f.nat_collection()}
    ).json()
    badge = f"#rows tr[data-id='{job['id']}'] .badge"
    job_url = f"/v1/training-jobs/{job['id']}"
    _until(lambda: client.get(job_url).json()["status"] == "running", what="the job to start")
    page.get(f"{url}/dashboard/#/training-jobs")
    wait(page, lambda d: text(d, badge) == "running", "the job running in the list")
    assert client.post(f"{job_url}/cancel").status_code == 200
    wait(page, lambda d: text(d, badge) == "cancelled", "the list to show it cancelled")


def test_a_project_key_sees_only_its_projects_models(browser, server, tmp_path) -> None:
    """Signed in with a project's key, the dashboard shows that project's models, not the
    default project's `demo` (issue 28 §2: the dashboard reads through the API, as the key)."""
    url, admin = server
    made = admin.post("/v1/projects", json={"name": "dashboard-viewers"})
    assert made.status_code == 201, made.text
    project_id = made.json()["id"]

    def secret(scopes: list[str]) -> str:
        key = admin.post(f"/v1/projects/{project_id}/keys", json={"name": "k", "scopes": scopes})
        assert key.status_code == 201, key.text
        return str(key.json()["secret"])

    writer, reader = secret(["write"]), secret(["read"])
    registered = admin.post(
        "/v1/models",
        json={"name": "viewers-model", "base_model": "tiny", "backend": "dry-run"},
        headers={"Authorization": f"Bearer {writer}"},
    )
    assert registered.status_code == 201, registered.text
    browser.get(f"{url}/dashboard/")
    browser.execute_script("sessionStorage.setItem('trainyard.apiKey', arguments[0])", reader)
    browser.get(f"{url}/dashboard/#/models")
    wait(browser, lambda d: count(d, "[data-model='viewers-model']"), "the project's model")
    assert count(browser, "[data-model='demo']") == 0
    screenshot(browser, tmp_path, "project-models")
    # Back to the admin key for the tests that follow.
    browser.execute_script("sessionStorage.setItem('trainyard.apiKey', arguments[0])", KEY)
