"""A client generated from the committed openapi.json drives a whole training job against
the live server: real HTTP on loopback, a bearer API key, the in-process worker and the
dry-run backend. What the client parses is what the schema promises, so a response the
schema documents wrongly (or not at all) fails here."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from http import HTTPStatus
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests import factories as f

pytestmark = pytest.mark.any_database

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "trainyard_generated_client"
API_KEY = "gen-client-key"
# The generator's only post-processing is running ruff over its output: none here, the
# generated code is imported exactly as the generator wrote it.
CONFIG = f"package_name_override: {PACKAGE}\npost_hooks: []\n"
SECONDS_PER_STEP = 0.6  # two gradient steps: long enough to watch a job at 50% through GET
MAX_BODY_BYTES = 16_384  # the job below is ~3 KB


class Generated:
    """The generated package, its modules looked up by dotted name under the package."""

    def __init__(self, package: str) -> None:
        self.package = package

    def __getitem__(self, module: str) -> ModuleType:
        return importlib.import_module(f"{self.package}.{module}")

    def model(self, name: str) -> Any:
        return getattr(self["models"], name)


@pytest.fixture(scope="session")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Generated]:
    out = tmp_path_factory.mktemp("generated-client")
    config = out / "config.yaml"
    config.write_text(CONFIG)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "openapi_python_client",
            "generate",
            "--path",
            str(ROOT / "openapi.json"),
            "--meta",
            "none",
            "--config",
            str(config),
            "--output-path",
            str(out / PACKAGE),
            "--fail-on-warning",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=out,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # Warnings name the parts of our schema the generator could not express.
    assert "warning" not in output.lower(), output
    sys.path.insert(0, str(out))
    try:
        yield Generated(PACKAGE)
    finally:
        sys.path.remove(str(out))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def _subsequence(wanted: list[str], seen: list[str]) -> bool:
    remaining = iter(seen)
    return all(item in remaining for item in wanted)


async def _events(gen: Generated, client: Any, job_id: str) -> list[Any]:
    """Every event of a job, two per page, following `next_cursor`."""
    events_api = gen["api.training_jobs.training_jobs_events"]
    page_type = gen.model("PageJobEvent")
    unset = gen["types"].UNSET
    events: list[Any] = []
    after: Any = unset
    for _ in range(50):
        response = await events_api.asyncio_detailed(job_id, client=client, after=after, limit=2)
        assert response.status_code == HTTPStatus.OK, response.content
        page = response.parsed
        assert isinstance(page, page_type)
        assert len(page.data) <= 2
        events.extend(page.data)
        if not page.has_more:
            assert page.next_cursor is None
            return events
        assert isinstance(page.next_cursor, str)
        after = int(page.next_cursor)
    raise AssertionError("the events pages never ended")


async def test_generated_client_drives_a_training_job(
    serve: Callable[..., Any], generated: Generated
) -> None:
    gen = generated
    client_module = gen["client"]
    models = gen["models"]
    create_model = gen["api.models.models_create"]
    get_model = gen["api.models.models_get"]
    create_job = gen["api.training_jobs.training_jobs_create"]
    get_job = gen["api.training_jobs.training_jobs_get"]
    readyz = gen["api.health.health_readyz"]

    async with serve(worker_enabled=True, api_keys=API_KEY, max_body_bytes=MAX_BODY_BYTES) as live:
        # raise_on_unexpected_status: a status the schema does not list fails the test.
        timeout = httpx.Timeout(10.0)
        client = client_module.AuthenticatedClient(
            base_url=live.url, token=API_KEY, timeout=timeout, raise_on_unexpected_status=True
        )
        stranger = client_module.AuthenticatedClient(
            base_url=live.url, token="not-the-key", timeout=timeout, raise_on_unexpected_status=True
        )
        anonymous = client_module.Client(
            base_url=live.url, timeout=timeout, raise_on_unexpected_status=True
        )
        async with client, stranger, anonymous:
            # Health stays open without a key.
            ready = await readyz.asyncio_detailed(client=anonymous)
            assert ready.status_code == HTTPStatus.OK, ready.content
            assert isinstance(ready.parsed, models.Readiness)
            assert ready.parsed.status == "ready"
            checks = set(ready.parsed.checks.additional_keys)
            assert checks == {"database", "worker", "backends", "models"}

            # A wrong key: a typed 401 problem, not a model.
            body = models.ModelCreate.from_dict(
                f.model_body("gen-agent", seconds_per_step=SECONDS_PER_STEP)
            )
            refused = await create_model.asyncio_detailed(client=stranger, body=body)
            assert refused.status_code == HTTPStatus.UNAUTHORIZED
            assert refused.headers["content-type"] == "application/problem+json"
            assert isinstance(refused.parsed, models.Problem)
            assert refused.parsed.status == 401
            assert "API key" in str(refused.parsed.detail)
            assert refused.headers["www-authenticate"] == "Bearer"

            # The body limit answers before any route runs; its 413 is documented on every
            # operation that takes a body, so it too arrives as a typed problem.
            too_big = models.ModelCreate.from_dict(
                f.model_body("gen-agent", note="x" * MAX_BODY_BYTES)
            )
            refused = await create_model.asyncio_detailed(client=client, body=too_big)
            assert refused.status_code == HTTPStatus.REQUEST_ENTITY_TOO_LARGE
            assert isinstance(refused.parsed, models.Problem)
            assert refused.parsed.status == 413
            assert refused.parsed.type_ == "urn:trainyard:problem:body-too-large"
            assert f"the limit is {MAX_BODY_BYTES}" in str(refused.parsed.detail)

            # Register a model on the dry-run backend.
            created = await create_model.asyncio_detailed(client=client, body=body)
            assert created.status_code == HTTPStatus.CREATED, created.content
            model = created.parsed
            assert isinstance(model, models.Model)
            assert (model.name, model.backend, model.current_step) == ("gen-agent", "dry-run", 0)
            assert model.config["seconds_per_step"] == SECONDS_PER_STEP
            assert created.headers["location"] == "/v1/models/gen-agent"
            again = await create_model.asyncio_detailed(client=client, body=body)
            assert again.status_code == HTTPStatus.OK and isinstance(again.parsed, models.Model)

            # A bad payload: an assistant turn without logprobs. The 422 problem names the
            # field by its path in the body.
            bad_payload: dict[str, Any] = {"model": "gen-agent", "collection": f.nat_collection()}
            bad_payload["collection"]["trajectories"][0][1]["episode"][2]["logprobs"] = None
            bad = await create_job.asyncio_detailed(
                client=client, body=models.TrainingJobCreate.from_dict(bad_payload)
            )
            assert bad.status_code == HTTPStatus.UNPROCESSABLE_ENTITY, bad.content
            assert bad.headers["content-type"] == "application/problem+json"
            problem = bad.parsed
            assert isinstance(problem, models.Problem)
            assert problem.status == 422
            assert problem.type_ == "urn:trainyard:problem:validation-error"
            assert isinstance(problem.errors, list) and problem.errors
            assert all(isinstance(e, models.FieldError) for e in problem.errors)
            paths = {(e.location, e.path, e.type_) for e in problem.errors}
            assert (
                models.FieldErrorLocation.BODY,
                "collection.trajectories[0][1].episode[2].logprobs",
                "missing_logprobs",
            ) in paths, paths

            # An unknown job: a typed 404 problem.
            missing = await get_job.asyncio_detailed("job_nope", client=client)
            assert missing.status_code == HTTPStatus.NOT_FOUND
            assert isinstance(missing.parsed, models.Problem)
            assert missing.parsed.status == 404
            assert missing.parsed.type_ == "urn:trainyard:problem:not-found"
            assert missing.parsed.instance == "/v1/training-jobs/job_nope"

            # Submit a NAT TrajectoryCollection: two trainable groups, two gradient steps.
            payload = {
                "model": "gen-agent",
                "collection": f.nat_collection(),
                "hyperparameters": {"learning_rate": 1e-5},
                "metadata": {"source": "generated-client"},
            }
            submitted = await create_job.asyncio_detailed(
                client=client,
                body=models.TrainingJobCreate.from_dict(payload),
                idempotency_key="gen-client-1",
            )
            assert submitted.status_code == HTTPStatus.ACCEPTED, submitted.content
            job = submitted.parsed
            assert isinstance(job, models.TrainingJob)
            assert job.status == models.JobStatus.QUEUED
            assert job.model == "gen-agent"
            assert (job.summary.num_groups, job.summary.num_trainable_groups) == (2, 2)
            assert job.summary.num_trajectories == 4
            assert job.metadata["source"] == "generated-client"
            assert job.result is None and job.error is None
            assert submitted.headers["location"] == f"/v1/training-jobs/{job.id}"
            replayed = await create_job.asyncio_detailed(
                client=client,
                body=models.TrainingJobCreate.from_dict(payload),
                idempotency_key="gen-client-1",
            )
            assert replayed.status_code == HTTPStatus.ACCEPTED, replayed.content
            assert replayed.headers["idempotent-replayed"] == "true"
            assert isinstance(replayed.parsed, models.TrainingJob)
            assert replayed.parsed.id == job.id

            # Watch it through GET until it ends.
            seen: list[Any] = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while True:
                polled = await get_job.asyncio_detailed(job.id, client=client)
                assert polled.status_code == HTTPStatus.OK, polled.content
                current = polled.parsed
                assert isinstance(current, models.TrainingJob)
                assert isinstance(current.progress, models.JobProgress)
                seen.append(current)
                if current.status in {
                    models.JobStatus.SUCCEEDED,
                    models.JobStatus.FAILED,
                    models.JobStatus.CANCELLED,
                }:
                    break
                assert loop.time() < deadline, f"job still {current.status}"
                await asyncio.sleep(0.05)

            done = seen[-1]
            assert done.status == models.JobStatus.SUCCEEDED, done.error
            assert isinstance(done.result, models.JobResult)
            assert (done.result.start_step, done.result.final_step) == (0, 1)
            assert isinstance(done.result.checkpoint_path, str)
            assert done.error is None
            assert (done.progress.step, done.progress.total, done.progress.percent) == (2, 2, 100)
            assert done.attempts == 1
            assert done.started_at is not None and done.finished_at is not None
            assert done.created_at <= done.started_at <= done.finished_at

            statuses = [j.status for j in seen]
            assert models.JobStatus.RUNNING in statuses, statuses
            steps = [j.progress.step for j in seen]
            assert steps == sorted(steps), steps
            halfway = [j for j in seen if j.status == models.JobStatus.RUNNING and j.progress.step]
            assert halfway, "never saw a running job's progress"
            assert (halfway[0].progress.step, halfway[0].progress.total) == (1, 2)
            assert halfway[0].progress.percent == 50

            # The model's step advanced by exactly one.
            after = await get_model.asyncio_detailed("gen-agent", client=client)
            assert after.status_code == HTTPStatus.OK
            assert isinstance(after.parsed, models.Model)
            assert after.parsed.current_step == model.current_step + 1

            # Its events, paged, tell the lifecycle in order.
            events = await _events(gen, client, job.id)
            assert all(isinstance(e, models.JobEvent) for e in events)
            assert [e.seq for e in events] == list(range(1, len(events) + 1))
            types = [e.type_ for e in events]
            lifecycle = [
                "job_queued",
                "job_claimed",
                "training_started",
                "gradient_step",
                "gradient_step",
                "training_ended",
            ]
            assert _subsequence(lifecycle, types), types
            assert types[0] == "job_queued" and types[-1] == "training_ended", types
            assert types.count("gradient_step") == 2, types
            gradient = [e.data for e in events if e.type_ == "gradient_step"]
            assert [(d["step"], d["total"]) for d in gradient] == [(1, 2), (2, 2)]
            created_at = [e.created_at for e in events]
            assert created_at == sorted(created_at)
