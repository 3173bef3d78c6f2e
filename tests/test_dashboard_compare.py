"""Comparing runs in the dashboard, in headless Chromium against a real `trainyard serve`
(keys on), with two runs the demo model really trained on the cpu backend: picked in the
runs list, their curves overlaid and their settings side by side, the differing values
marked; a link to a run that is not there says so. The server, browser and helpers are
tests/test_dashboard.py's (skipped there without chromedriver, so here too)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By

from tests import test_dashboard as dashboard
from tests.processes import PATIENCE
from tests.test_dashboard import KEY, _until, click, count, run_body, screenshot, text, wait

# Its fixtures, as this module's own: one server and one browser for this module too.
server, browser, page = dashboard.server, dashboard.browser, dashboard.page

pytestmark = [pytest.mark.slow, pytest.mark.torch]


def _train(client: httpx.Client, steps: int, learning_rate: float, temperature: float) -> str:
    body = run_body(steps)
    body["hyperparameters"] = {"learning_rate": learning_rate}
    body["recipe"]["sampling"]["temperature"] = temperature
    body["validation"] = {"every_steps": 2, "num_generations": 4}
    created = client.post("/v1/runs", json=body)
    assert created.status_code == 202, created.text
    run_id: str = created.json()["id"]
    # One run at a time holds the demo model: the second starts when the first has ended.
    status = lambda: client.get(f"/v1/runs/{run_id}").json()["status"]  # noqa: E731
    _until(lambda: status() in ("succeeded", "failed", "cancelled"), 60, f"run {run_id}")
    assert status() == "succeeded"
    return run_id


@pytest.fixture(scope="module")
def two_runs(server: tuple[str, httpx.Client]) -> list[str]:
    """Two runs that differ in steps, learning rate and temperature, both ended."""
    _, client = server
    return [_train(client, 3, 0.05, 1.0), _train(client, 4, 0.02, 0.7)]


def _curves(client: httpx.Client, run_id: str) -> dict[str, int]:
    rows = client.get(f"/v1/runs/{run_id}/metrics?limit=1000").json()["data"]
    steps = [r for r in rows if r["kind"] == "step"]
    return {
        "reward": sum(isinstance(r["data"].get("reward_mean"), float) for r in steps),
        "validation": sum(r["kind"] == "validation" for r in rows),
        "loss": sum(isinstance(r["data"].get("loss"), float) for r in steps),
    }


def _row(driver: Any, setting: str) -> list[str]:
    """A settings row's cells after its name, read in one step."""
    script = (
        "const r = document.querySelector(`#settings tr[data-setting='${arguments[0]}']`);"
        "return r ? [...r.querySelectorAll('td')].map((c) => c.innerText.trim()) : null"
    )
    return list(driver.execute_script(script, setting) or [])


def test_two_runs_picked_in_the_list_show_overlaid_curves_and_differing_settings(
    page, server, two_runs, tmp_path
) -> None:
    url, client = server
    first, second = two_runs
    page.get(f"{url}/dashboard/#/runs")
    for run_id in (first, second):
        box = f"#rows tr[data-id='{run_id}'] input[name='compare']"
        wait(page, lambda d, box=box: click(d, box), f"a tick for {run_id}")
    wait(page, lambda d: d.find_element(By.ID, "compare").is_enabled(), "Compare enabled")
    assert text(page, "#compare") == "Compare 2 runs"
    click(page, "#compare")
    wait(page, lambda d: count(d, "[data-page='compare'] #settings tr"), "the comparison")
    assert page.current_url.endswith(f"#/compare?runs={first},{second}")
    assert text(page, "nav a.here") == "Runs"

    def drawn(d: Any) -> bool:  # a point per row of each run's curves, in its colour
        for i, run_id in enumerate(two_runs):
            for chart, expected in _curves(client, run_id).items():
                points = f"[data-chart='{chart}'] .series.s{i}[data-series='{run_id}'] .point"
                if count(d, points) != expected:
                    return False
        return True

    wait(page, drawn, "both runs' curves on each chart")
    # On the runs' own steps: the second run started where the first left the model, and
    # its baseline validation is at its step 0 as the first one's is.
    settings = [client.get(f"/v1/runs/{r}/settings").json() for r in two_runs]
    assert [s["start_step"] for s in settings] == [0, 3]
    tips = "return [...document.querySelectorAll(arguments[0])].map((t) => t.textContent)"
    for i, run_id in enumerate(two_runs):
        shown = page.execute_script(tips, f"[data-chart='validation'] .s{i} .point title")
        assert any(t.startswith(f"{run_id}, step 0:") for t in shown), shown
    assert all(_curves(client, run_id)["reward"] >= 3 for run_id in two_runs)
    for chart in ("reward", "validation", "loss"):
        legend = text(page, f"[data-chart='{chart}'] .legend")
        assert first in legend and second in legend, (chart, legend)
    # Settings side by side: what differs is marked, what is the same is not.
    assert _row(page, "hyperparameters.learning_rate") == ["0.05", "0.02"]
    assert _row(page, "recipe.sampling.temperature") == ["1", "0.7"]
    assert _row(page, "schedule.max_steps") == ["3", "4"]
    assert _row(page, "steps") == ["3 of 3", "4 of 4"]
    assert _row(page, "model") == ["demo", "demo"]
    assert _row(page, "recipe.grader.type") == ["regex", "regex"]
    marked = page.find_elements(By.CSS_SELECTOR, "#settings tr.differs")
    names = {row.get_attribute("data-setting") for row in marked}
    assert {"hyperparameters.learning_rate", "recipe.sampling.temperature"} <= names
    assert {"schedule.max_steps", "steps"} <= names
    assert not names & {"model", "status", "recipe.grader.type", "recipe.num_generations"}
    screenshot(page, tmp_path, "compare", size=(1280, 1800))
    # Only what differs, on request.
    click(page, "#only-differences")
    model_row = page.find_element(By.CSS_SELECTOR, "#settings tr[data-setting='model']")
    assert not model_row.is_displayed()
    rate = "#settings tr[data-setting='hyperparameters.learning_rate']"
    assert page.find_element(By.CSS_SELECTOR, rate).is_displayed()
    # The link is the comparison: reloaded (the key kept for the tab), it shows it again.
    page.refresh()
    wait(page, lambda d: _row(d, "schedule.max_steps") == ["3", "4"], "the comparison again")
    assert count(page, "#api-key") == 0 and KEY not in page.current_url
    # A run's own page places them so too: the second run's baseline at its step 0.
    page.get(f"{url}/dashboard/#/runs/{second}")
    baseline = "[data-chart='reward'] [data-series='validation'] .point title"
    first_tip = lambda d: (d.execute_script(tips, baseline) or [""])[0]  # noqa: E731
    wait(page, lambda d: first_tip(d).startswith("validation score, step 0:"), "its baseline")
    page.back()
    wait(page, lambda d: _row(d, "schedule.max_steps") == ["3", "4"], "the comparison again")
    # On a phone: nothing wider than the screen (the settings table scrolls on its own).
    page.set_window_size(390, 844)
    wide = "return document.documentElement.scrollWidth - window.innerWidth"
    wait(page, lambda d: d.execute_script(wide) <= 0, "a page as narrow as a phone")
    page.set_window_size(1280, 900)


def test_a_link_to_a_run_that_is_not_there_says_so_after_the_key(browser, server, two_runs) -> None:
    url, _ = server
    browser.get(f"{url}/dashboard/")
    browser.execute_script("sessionStorage.clear()")
    browser.get_log("browser")
    # A shared link opened in a new tab: the key first, then the comparison it names.
    browser.get(f"{url}/dashboard/#/compare?runs={two_runs[0]},run_nope")
    field = wait(browser, lambda d: d.find_elements(By.ID, "api-key"), "the key form")[0]
    field.send_keys(KEY)
    click(browser, ".key-form button")
    problem = "[data-page='compare'] [data-problem]"
    wait(browser, lambda d: "run_nope" in text(d, problem), "a message naming the bad run")
    assert "404" in text(browser, problem) and "no run" in text(browser, problem)
    assert "nothing to compare" in text(browser, "[data-page='compare']")
    assert count(browser, "#charts") == 0
    # One run is not a comparison either.
    browser.get(f"{url}/dashboard/#/compare?runs={two_runs[0]}")
    wait(browser, lambda d: "Pick 2 to 8 runs" in text(d, problem), "a message asking for two")
    # The only console errors: the 401 before the key and the 404 of the missing run.
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert all("status of 401" in m or "run_nope" in m for m in errors), errors


def test_a_run_still_going_gains_points_in_the_comparison(page, server, two_runs) -> None:
    url, client = server
    body = run_body(3)
    created = client.post("/v1/runs", json=body)
    assert created.status_code == 202, created.text
    going = created.json()["id"]
    # Held (the child under way finishes) until the page is open, however fast it trains.
    assert client.post(f"/v1/runs/{going}/pause").status_code == 200
    page.get(f"{url}/dashboard/#/compare?runs={two_runs[0]},{going}")
    points = f"[data-chart='reward'] [data-series='{going}'] .point"
    wait(page, lambda d: count(d, "#settings tr"), "the comparison")
    before = count(page, points)
    assert before < 3
    assert client.post(f"/v1/runs/{going}/resume").status_code == 200
    wait(page, lambda d: count(d, points) == 3, "a point per step as they land", timeout=PATIENCE)
    wait(page, lambda d: _row(d, "steps")[1] == "3 of 3", "its steps")
    wait(page, lambda d: _row(d, "status")[1] == "succeeded", "it ended", timeout=PATIENCE)
