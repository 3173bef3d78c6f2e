"""The usage page in a real browser (`tests/test_dashboard.py`'s Chromium and console
checks) against `trainyard serve` over loopback: jobs of two projects whose times are set
in the database, so every figure the page draws is known; an admin picks a project, a
project's key sees its own usage only. Without chromedriver the module is skipped (under
CI, it fails)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from selenium.webdriver.support.ui import Select

from app.settings import Settings
from tests import factories as f
from tests.processes import free_port, start_api, stop, wait_ready
from tests.test_dashboard import AUTH, KEY, browser, count, page, screenshot, text, wait  # noqa: F401
from tests.test_usage import _times

pytestmark = [pytest.mark.slow]
DAY = datetime(2026, 11, 20, tzinfo=UTC)
PRICES = {"trainer_hour": 3.6, "rollout_hour": 1.8}
WINDOW = "from=2026-11-19&to=2026-11-23"


@pytest.fixture(scope="module")
def known(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server without a worker: two projects' jobs, their times set in its database."""
    root = tmp_path_factory.mktemp("dashboard-usage")
    database_url = f"sqlite+aiosqlite:///{root / 'trainyard.db'}"
    settings = Settings(database_url=database_url, data_dir=root / "data")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (root / "serve.log").open("wb") as output:
        process = start_api(
            settings,
            port,
            output=output,
            TRAINYARD_API_KEYS=KEY,
            TRAINYARD_WORKER_ENABLED="false",
            TRAINYARD_PRICES=json.dumps(PRICES),
            TRAINYARD_PRICE_CURRENCY="EUR",
        )
        try:
            asyncio.run(wait_ready(url, [process]))
            with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
                yield {"url": url, "client": client, **_jobs(client, database_url)}
        finally:
            stop(process)


def _jobs(client: httpx.Client, database_url: str) -> dict[str, Any]:
    made: dict[str, Any] = {}
    for name in ("north", "south"):
        pid = client.post("/v1/projects", json={"name": name}).json()["id"]
        secret = client.post(f"/v1/projects/{pid}/keys", json={"name": "k", "scopes": ["write"]})
        made[name] = {"id": pid, "key": secret.json()["secret"]}
        auth = {"Authorization": f"Bearer {made[name]['key']}"}
        assert client.post("/v1/models", json=f.model_body(name), headers=auth).status_code == 201
    # north: 600 s on 11-20, 1200 s + 300 s on 11-21; south: 3600 s on 11-22.
    spans = [
        ("north", DAY, 600),
        ("north", DAY + timedelta(days=1), 1200),
        ("north", DAY + timedelta(days=1, hours=5), 300),
        ("south", DAY + timedelta(days=2), 3600),
    ]
    for name, started, seconds in spans:
        auth = {"Authorization": f"Bearer {made[name]['key']}"}
        body = {"model": name, "collection": f.nat_collection()}
        job = client.post("/v1/training-jobs", json=body, headers=auth)
        assert job.status_code == 202, job.text
        finished = started + timedelta(seconds=seconds)
        asyncio.run(
            _times(
                database_url,
                job.json()["id"],
                status="succeeded",
                started_at=started,
                finished_at=finished,
            )
        )
    return made


@pytest.fixture(scope="module")
def server(known: dict[str, Any]) -> Iterator[tuple[str, httpx.Client]]:
    """What `tests/test_dashboard.py`'s browser and page fixtures take."""
    yield known["url"], known["client"]


def bars(driver: Any, chart: str) -> dict[str, float]:
    script = (
        "return [...document.querySelectorAll(`[data-chart='${arguments[0]}'] rect.bar`)]"
        ".map((r) => [r.dataset.day, Number(r.dataset.value)])"
    )
    return dict(driver.execute_script(script, chart))


def cell(driver: Any, day: str, column: str) -> str:
    return text(driver, f"[data-page='usage'] tr[data-day='{day}'] td[data-column='{column}']")


def test_an_admin_sees_every_projects_usage_by_day_and_picks_one(
    page: Any,  # noqa: F811
    known: dict[str, Any],
    tmp_path: Any,
) -> None:
    page.get(f"{known['url']}/dashboard/#/usage?{WINDOW}")
    wait(page, lambda d: count(d, "[data-page='usage'] tr[data-day='total']"), "the totals")
    assert text(page, "#usage-scope") == "every project"
    # A bar per day of the window, a day without jobs at 0.
    assert bars(page, "trainer_seconds") == {
        "2026-11-19": 0,
        "2026-11-20": 600,
        "2026-11-21": 1500,
        "2026-11-22": 3600,
    }
    assert cell(page, "2026-11-21", "jobs") == "2"
    assert cell(page, "total", "trainer_seconds") == "5700"
    assert cell(page, "total", "cost") == "5.70"  # 5700 s at 3.6 EUR an hour
    assert "EUR" in text(page, "[data-page='usage'] thead")
    # Every numeric column of the answer has its chart and its column, whatever its name.
    answer = known["client"].get("/v1/usage", params={"group_by": "day"}).json()
    numeric = [k for k, v in answer["total"].items() if isinstance(v, int | float)]
    for column in numeric:
        assert count(page, f"[data-chart='{column}']") == 1, column
    screenshot(page, tmp_path, "usage")
    Select(page.find_element("id", "usage-project")).select_by_visible_text("south")
    wait(page, lambda d: text(d, "#usage-scope") == "south", "the project picked")
    wait(page, lambda d: cell(d, "total", "trainer_seconds") == "3600", "south's total")
    assert bars(page, "trainer_seconds")["2026-11-21"] == 0
    assert known["south"]["id"] in page.current_url


def test_a_project_key_sees_its_own_usage_without_a_picker(
    browser: Any,  # noqa: F811
    known: dict[str, Any],
) -> None:
    browser.get(f"{known['url']}/dashboard/")
    browser.execute_script(
        "sessionStorage.setItem('trainyard.apiKey', arguments[0])", known["north"]["key"]
    )
    browser.get(f"{known['url']}/dashboard/#/usage?{WINDOW}")
    wait(browser, lambda d: count(d, "[data-page='usage'] tr[data-day='total']"), "the totals")
    assert count(browser, "#usage-project") == 0
    assert text(browser, "#usage-scope") == "this key's project"
    assert cell(browser, "total", "trainer_seconds") == "2100"
    assert cell(browser, "total", "cost") == "2.10"
    assert bars(browser, "trainer_seconds")["2026-11-22"] == 0
    browser.execute_script("sessionStorage.setItem('trainyard.apiKey', arguments[0])", KEY)
