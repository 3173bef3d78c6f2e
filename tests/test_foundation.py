"""Health, errors, auth, limits, metrics and the OpenAPI document, over real HTTP."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest

from app.main import create_app
from app.migrate import head_revision
from app.settings import Settings
from tests.factories import model_body

ROOT = Path(__file__).resolve().parent.parent


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_healthz_is_plain_and_open(serve) -> None:
    async with serve(api_keys="secret") as live:
        response = await live.client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_readyz_names_every_check_when_ready(serve) -> None:
    async with serve(worker_enabled=True) as live:
        response = await live.client.get("/readyz")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ready"
    assert set(body["checks"]) == {"database", "worker", "backends", "models"}
    assert f"head {head_revision()}" in body["checks"]["database"]["detail"]


async def test_readyz_is_503_naming_the_database_when_it_is_unreachable(serve, tmp_path) -> None:
    live = serve()
    async with live:
        # Point the running app at a Postgres port where nothing listens.
        from app.db import create_engine

        good = live.app.state.engine
        live.app.state.engine = create_engine(
            f"postgresql+asyncpg://postgres@127.0.0.1:{closed_port()}/test"
        )
        try:
            response = await live.client.get("/readyz")
        finally:
            await live.app.state.engine.dispose()
            live.app.state.engine = good
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["checks"]["database"]["ok"] is False
    assert "database" in body["detail"]
    assert body["checks"]["backends"]["ok"] is True


async def test_readyz_reports_a_schema_behind_head(serve) -> None:
    async with serve() as live:
        from app.migrate import migrate

        await migrate(live.app.state.engine, "base", downgrade=True)
        response = await live.client.get("/readyz")
    assert response.status_code == 503
    assert "schema at None" in response.json()["checks"]["database"]["detail"]


async def test_readyz_polled_logs_nothing_and_still_sees_a_schema_behind_head(
    serve, caplog
) -> None:
    """A probe every few seconds must not fill the log: /readyz reads the schema's revision
    with one query and builds no Alembic context; a schema behind head is still not ready."""
    from app.migrate import migrate

    caplog.set_level(logging.DEBUG, logger="alembic")
    async with serve() as live:
        caplog.clear()
        for _ in range(20):
            assert (await live.client.get("/readyz")).status_code == 200
        assert [r for r in caplog.records if r.name.startswith("alembic")] == []

        await migrate(live.app.state.engine, "-1", downgrade=True)
        caplog.clear()
        for _ in range(5):
            response = await live.client.get("/readyz")
            assert response.status_code == 503
        assert [r for r in caplog.records if r.name.startswith("alembic")] == []
    detail = response.json()["checks"]["database"]["detail"]
    assert detail.endswith(f"code expects {head_revision()}")
    assert f"schema at {head_revision()}" not in detail
    assert "schema at None" not in detail


async def test_readyz_names_an_unreachable_backend(serve, tmp_path) -> None:
    from app.backends.dry_run import DryRunBackend

    class Unreachable(DryRunBackend):
        async def healthcheck(self) -> None:
            raise ConnectionError("trainer at 10.0.0.9:7999 refused the connection")

    async with serve(backend_overrides={"dry-run": Unreachable(tmp_path / "x")}) as live:
        live.app.state.backends.get("dry-run")
        response = await live.client.get("/readyz")
    assert response.status_code == 503
    assert "refused" in response.json()["checks"]["backends"]["detail"]


async def test_unknown_route_is_problem_json(live) -> None:
    response = await live.client.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["title"] == "Not Found"
    assert response.json()["instance"] == "/v1/nothing-here"


async def test_wrong_method_is_problem_json(live) -> None:
    response = await live.client.delete("/v1/models")
    assert response.status_code == 405
    assert response.headers["content-type"] == "application/problem+json"


async def test_validation_errors_list_each_field_path(live) -> None:
    body = model_body()
    body.update(name="bad name!", base_model="")
    response = await live.client.post("/v1/models", json=body)
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    paths = {(e["location"], e["path"]) for e in response.json()["errors"]}
    assert paths == {("body", "name"), ("body", "base_model")}


async def test_malformed_json_is_a_422_problem(live) -> None:
    response = await live.client.post(
        "/v1/models", content=b'{"name": ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["errors"][0]["type"] == "json_invalid"


@pytest.mark.parametrize(
    ("headers", "sent"),
    [
        ({"content-type": "text/plain"}, "Content-Type 'text/plain' was sent"),
        ({"content-type": "application/x-www-form-urlencoded"}, "'application/x-www-form-url"),
        ({}, "no Content-Type was sent"),
    ],
)
async def test_a_json_body_sent_as_another_type_is_a_415_naming_the_header(
    live, headers, sent
) -> None:
    # curl's `-d` alone sends a form's type; a JSON text is not read as JSON under it.
    response = await live.client.post(
        "/v1/models", content=json.dumps(model_body()).encode(), headers=headers
    )
    listed = await live.client.get("/v1/models")
    assert response.status_code == 415, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert "send Content-Type: application/json" in problem["detail"]
    assert sent in problem["detail"]
    assert problem["errors"] == [
        {
            "location": "header",
            "path": "content-type",
            "message": problem["detail"],
            "type": "media_type",
        }
    ]
    assert listed.json()["data"] == []


async def test_api_keys_guard_the_api_but_not_health(serve) -> None:
    async with serve(api_keys="k1, k2") as live:
        missing = await live.client.get("/v1/models")
        wrong = await live.client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        right = await live.client.get("/v1/models", headers={"Authorization": "Bearer k2"})
        health = await live.client.get("/healthz")
        metrics = await live.client.get("/metrics")  # names every project: a key's
        scraped = await live.client.get("/metrics", headers={"Authorization": "Bearer k1"})
    assert missing.status_code == wrong.status_code == metrics.status_code == 401
    assert missing.headers["content-type"] == "application/problem+json"
    assert missing.headers["www-authenticate"] == "Bearer"
    assert right.status_code == health.status_code == scraped.status_code == 200


async def test_body_over_the_limit_is_413_problem(serve) -> None:
    async with serve(max_body_bytes=4096) as live:
        big = model_body()
        big["config"] = {"seconds_per_step": 0, "pad": "x" * 10_000}
        response = await live.client.post("/v1/models", json=big)
        listed = await live.client.get("/v1/models")
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/problem+json"
    assert listed.json()["data"] == []


async def test_body_over_the_limit_without_content_length_is_413(serve) -> None:
    async with serve(max_body_bytes=4096) as live:

        async def chunks():
            for _ in range(10):
                yield b"x" * 1000

        response = await live.client.post(
            "/v1/models", content=chunks(), headers={"content-type": "application/json"}
        )
    assert response.status_code == 413


async def test_metrics_count_requests_by_route_and_jobs_by_status(live) -> None:
    await live.client.get("/v1/models/none")
    response = await live.client.get("/metrics")
    text = response.text
    assert response.status_code == 200
    assert (
        'trainyard_http_requests_total{method="GET",route="/v1/models/{name}",status="404"} 1.0'
        in text
    )
    assert 'trainyard_jobs{kind="training",status="queued"} 0.0' in text
    assert "trainyard_queue_depth 0.0" in text


def test_openapi_json_is_current(tmp_path) -> None:
    settings = Settings(database_url=f"sqlite+aiosqlite:///{tmp_path}/x.db")
    current = create_app(settings).openapi()
    committed = json.loads((ROOT / "openapi.json").read_text())
    assert committed == current, "openapi.json is stale: run `make openapi`"


def test_openapi_documents_problem_errors_and_stable_ids(tmp_path) -> None:
    schema = create_app(Settings(database_url=f"sqlite+aiosqlite:///{tmp_path}/x.db")).openapi()
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids))
    assert "training_jobs-create" in ids
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, item in schema["paths"].items():
        for method, op in item.items():
            assert len(op["tags"]) == 1, (path, method)
            for status, response in op["responses"].items():
                if not status.startswith(("4", "5")):
                    continue
                content = response["content"]
                if path.startswith("/openai/") and "application/json" in content:
                    # The gateway's own errors use OpenAI's envelope, which its clients parse.
                    assert content["application/json"]["schema"]["required"] == ["error"]
                else:
                    assert "application/problem+json" in content, (path, status)
            if path.startswith(("/v1/", "/openai/")):
                assert "401" in op["responses"], (path, method)


@pytest.mark.parametrize("value", ["", "a,b"])
def test_api_keys_setting_parses_comma_lists(value: str) -> None:
    assert [k.get_secret_value() for k in Settings(api_keys=value).api_keys] == [
        k for k in value.split(",") if k
    ]


async def test_a_pooled_connection_the_server_dropped_is_replaced_before_use(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not database_url.startswith("postgresql"):
        pytest.skip("a server that drops connections is Postgres'")
    from sqlalchemy import text

    from app import db

    engine = db.create_engine(database_url)
    other = db.create_engine(database_url)
    try:
        async with engine.connect() as conn:
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        async with other.begin() as conn:  # what a database restart does to idle connections
            await conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        monkeypatch.setattr(db, "PING_AFTER_IDLE_SECONDS", 0.0)  # it has been idle "long"
        async with engine.connect() as conn:
            fresh = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        assert fresh != pid
    finally:
        await engine.dispose()
        await other.dispose()


@pytest.mark.parametrize("value", [",", " , ", ",,,", " ", "\t,\t"])
def test_api_keys_with_no_key_in_them_are_refused(value: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="no key in it"):
        Settings(api_keys=value)


async def test_a_missing_resource_is_named_as_given_at_its_path_parameter(serve) -> None:
    """Every kind of 404 says which resource (`no run 'run_x'`) and, like a 422 names a body
    field, has an `errors` entry naming the path parameter that named it."""
    async with serve(worker_enabled=False) as live:
        answers = {
            f"{method} {url}": await live.client.request(method, url)
            for method, url in [
                ("GET", "/v1/training-jobs/job_x"),
                ("POST", "/v1/training-jobs/job_x/cancel"),
                ("GET", "/v1/training-jobs/job_x/events"),
                ("GET", "/v1/rollout-jobs/job_y"),
                ("POST", "/v1/rollout-jobs/job_y/cancel"),
                ("GET", "/v1/runs/run_x"),
                ("POST", "/v1/runs/run_x/cancel"),
                ("POST", "/v1/runs/run_x/pause"),
                ("GET", "/v1/runs/run_x/metrics"),
                ("GET", "/v1/runs/run_x/events"),
                ("GET", "/v1/models/agent_x"),
                ("GET", "/v1/models/agent_x/checkpoints"),
                ("GET", "/v1/datasets/ds_x"),
                ("DELETE", "/v1/datasets/ds_x"),
                ("GET", "/v1/webhooks/wh_x"),
                ("GET", "/v1/webhooks/wh_x/deliveries"),
                ("POST", "/v1/workers/wk_x/drain"),
            ]
        }
    expected = {
        "GET /v1/training-jobs/job_x": ("no training job 'job_x'", "job_id"),
        "POST /v1/training-jobs/job_x/cancel": ("no training job 'job_x'", "job_id"),
        "GET /v1/training-jobs/job_x/events": ("no training job 'job_x'", "job_id"),
        "GET /v1/rollout-jobs/job_y": ("no rollout job 'job_y'", "job_id"),
        "POST /v1/rollout-jobs/job_y/cancel": ("no rollout job 'job_y'", "job_id"),
        "GET /v1/runs/run_x": ("no run 'run_x'", "run_id"),
        "POST /v1/runs/run_x/cancel": ("no run 'run_x'", "run_id"),
        "POST /v1/runs/run_x/pause": ("no run 'run_x'", "run_id"),
        "GET /v1/runs/run_x/metrics": ("no run 'run_x'", "run_id"),
        "GET /v1/runs/run_x/events": ("no run 'run_x'", "job_id"),
        "GET /v1/models/agent_x": ("no model 'agent_x'", "name"),
        "GET /v1/models/agent_x/checkpoints": ("no model 'agent_x'", "name"),
        "GET /v1/datasets/ds_x": ("no dataset 'ds_x'", "dataset_id"),
        "GET /v1/webhooks/wh_x": ("no webhook endpoint 'wh_x'", "endpoint_id"),
        "GET /v1/webhooks/wh_x/deliveries": ("no webhook endpoint 'wh_x'", "endpoint_id"),
        "POST /v1/workers/wk_x/drain": ("no live worker 'wk_x'", "worker_id"),
        "DELETE /v1/datasets/ds_x": ("no dataset 'ds_x'", "dataset_id"),
    }
    for url, response in answers.items():
        assert response.status_code == 404, (url, response.text)
        assert response.headers["content-type"] == "application/problem+json"
        problem = response.json()
        detail, param = expected[url]
        assert problem["detail"] == detail, (url, problem)
        assert problem["errors"] == [
            {"location": "path", "path": param, "message": detail, "type": "not_found"}
        ], (url, problem)
