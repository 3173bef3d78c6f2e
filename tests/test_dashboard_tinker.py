"""A Tinker training run on the dashboard, in a real browser: a run driven through the real
`tinker` SDK (its own environment, `.venv-tinker`) against `trainyard serve` over loopback,
then its model's card links to a page whose loss chart has a point per optimizer step, at
the loss the SDK got back, and whose learning-rate chart has the rates it asked for; the
same numbers as `GET /v1/models/{name}/tinker-metrics` pages them; a page open while a run
trains gains its points as the steps land.

The browser and its console checks are `tests/test_dashboard.py`'s; without chromedriver or
the SDK's environment the module is skipped (under CI, it fails)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.test_dashboard import KEY as DASHBOARD_KEY
from tests.test_dashboard import browser, count, page, screenshot, text, wait  # noqa: F401
from tests.test_readme import Server
from tests.test_tinker_sdk import DATA, PYTHON, run_sdk, sdk_env
from tests.test_tinker_sdk import KEY as TINKER_KEY  # the SDK's (`tml-`)

pytestmark = [pytest.mark.slow, pytest.mark.torch]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{PYTHON} is missing: CI builds it (make .venv-tinker/.installed)")
        pytest.skip("no Tinker SDK environment: make .venv-tinker/.installed")
    tmp = tmp_path_factory.mktemp("tinker-dashboard")
    server = Server(tmp / "var", tmp / "server.log")
    try:
        server.start({"TRAINYARD_API_KEYS": f"{TINKER_KEY},{DASHBOARD_KEY}"})
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(live: Server) -> Iterator[tuple[str, httpx.Client]]:
    """What `tests/test_dashboard.py`'s browser and page fixtures take."""
    url = f"http://127.0.0.1:{live.port}"
    with httpx.Client(base_url=url, headers=live.auth, timeout=30) as client:
        yield url, client


@pytest.fixture(scope="module")
def trained(live: Server) -> dict[str, Any]:
    ran = run_sdk(live, (DATA / "steps.py").read_text())
    assert ran.returncode == 0, ran.stdout + ran.stderr + live.tail()
    result: dict[str, Any] = json.loads(ran.stdout.strip().splitlines()[-1])
    session, _, n = result["model_id"].split(":")
    result["run"] = f"tinker-{session}-{n}"
    return result


def test_the_api_pages_a_tinker_runs_steps_from_its_journal(
    server: tuple[str, httpx.Client], trained: dict[str, Any]
) -> None:
    _, client = server
    path = f"/v1/models/{trained['run']}/tinker-metrics"
    first = client.get(path, params={"limit": 3})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["has_more"] is True and body["next_cursor"] == "3"
    rest = client.get(path, params={"after": body["next_cursor"]}).json()
    assert rest["has_more"] is False and rest["next_cursor"] is None
    steps = body["data"] + rest["data"]
    # Four steps (the fifth forward_backward is not stepped yet), each with the loss the SDK
    # got back for the calls it applied, and the learning rate it was asked for.
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["forward_backward"] for s in steps] == [1, 2, 1, 1]
    assert [s["loss"] for s in steps] == pytest.approx(trained["losses"], rel=1e-12)
    assert [s["learning_rate"] for s in steps] == trained["rates"]
    assert [s["metrics"] for s in steps] == [{"learning_rate": r} for r in trained["rates"]]
    assert steps[0]["loss"] > steps[-1]["loss"]  # it trained
    seqs = [s["seq"] for s in steps]
    assert seqs == sorted(seqs)
    # Not a Tinker run, no model, a bad page: problem+json naming what is wrong.
    demo = client.get("/v1/models/demo/tinker-metrics")
    assert demo.status_code == 404 and "no Tinker training run 'demo'" in demo.text
    assert demo.headers["content-type"].startswith("application/problem+json")
    assert client.get("/v1/models/nothing/tinker-metrics").status_code == 404
    bad = client.get(path, params={"limit": 0, "after": -1})
    assert bad.status_code == 422, bad.text
    named = {(e["location"], e["path"]) for e in bad.json()["errors"]}
    assert named == {("query", "limit"), ("query", "after")}, bad.json()


def test_the_dashboard_draws_a_tinker_runs_losses(
    page: Any,  # noqa: F811
    server: tuple[str, httpx.Client],
    trained: dict[str, Any],
    tmp_path: Any,
) -> None:
    url, client = server
    run = trained["run"]
    page.get(f"{url}/dashboard/#/models")
    card = f"[data-model='{run}']"
    wait(page, lambda d: count(d, card), "the Tinker run's card")
    link = f"{card} a[href='#/tinker/{run}']"
    wait(page, lambda d: count(d, link), "its link to the losses")
    assert count(page, "[data-model='demo'] a[href^='#/tinker/']") == 0  # not a Tinker run
    page.find_element("css selector", link).click()
    loss = "[data-chart='loss'] circle.point"
    wait(page, lambda d: count(d, loss) == 4, "four points on the loss chart")
    drawn = page.execute_script(
        "return [...document.querySelectorAll(arguments[0])]"
        ".map((c) => [Number(c.dataset.x), Number(c.dataset.y)])",
        loss,
    )
    api = client.get(f"/v1/models/{run}/tinker-metrics").json()["data"]
    assert drawn == [[s["step"], s["loss"]] for s in api]
    assert [y for _, y in drawn] == pytest.approx(trained["losses"], rel=1e-12)
    rates = page.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((c) => Number(c.dataset.y))",
        "[data-chart='learning_rate'] circle.point",
    )
    assert rates == trained["rates"]
    assert "(4)" in text(page, "[data-chart='loss'] .legend")
    assert "Optimizer steps" in text(page, "[data-page='tinker']")
    screenshot(page, tmp_path, "tinker-run")


def test_the_page_gains_a_point_as_a_step_lands(
    page: Any,  # noqa: F811
    live: Server,
    server: tuple[str, httpx.Client],
) -> None:
    """The page open on a run that is training: two points, then, as the SDK goes on, the
    other two, without a reload."""
    url, _ = server
    with subprocess.Popen(
        [str(PYTHON), "-c", (DATA / "steps.py").read_text(), "pause"],
        env=sdk_env(live),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as sdk:
        assert sdk.stdin is not None and sdk.stdout is not None
        first = json.loads(sdk.stdout.readline() or "{}")
        assert first.get("model_id"), sdk.stderr.read() if sdk.stderr else ""
        session, _, n = first["model_id"].split(":")
        page.get(f"{url}/dashboard/#/tinker/tinker-{session}-{n}")
        loss = "[data-chart='loss'] circle.point"
        wait(page, lambda d: count(d, loss) == 2, "two points")
        out, err = sdk.communicate("go on\n", timeout=300)
    assert sdk.returncode == 0, out + err + live.tail()
    done = json.loads(out.strip().splitlines()[-1])
    wait(page, lambda d: count(d, loss) == 4, "four points, without a reload")
    drawn = page.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((c) => Number(c.dataset.y))",
        loss,
    )
    assert drawn == pytest.approx(done["losses"], rel=1e-12)
    assert drawn[:2] == pytest.approx(first["losses"], rel=1e-12)
