"""The client SDK (clients/python) against the real server over loopback HTTP: every
operation, retries and idempotent submits through a proxy that drops connections and
answers 503/429 with Retry-After, typed problem errors, event streams that reconnect.

The sync client runs in a thread (the server runs on the test's event loop); the async
client on the loop itself. Nothing of the server is mocked: the faults come from
tests/faulty_proxy.py, between the client and the server.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import re
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.backends.tiny_model import make_tiny_model
from tests import factories as f
from tests.conftest import LiveServer
from tests.faulty_proxy import DROP_AFTER, DROP_BEFORE, FORWARD, FaultyProxy, answer, cut_stream
from tests.processes import PATIENCE
from trainyard_client import (
    AsyncTrainyard,
    AuthenticationError,
    ConflictError,
    NotFoundError,
    PayloadTooLargeError,
    Progress,
    RetryPolicy,
    ServiceUnavailableError,
    Trainyard,
    ValidationError,
    WaitTimeoutError,
)
from trainyard_client._calls import OPERATIONS

pytestmark = pytest.mark.any_database

FAST = RetryPolicy(max_retries=5, base_delay=0.05, max_delay=0.2)
EXAMPLES = [
    {"id": "yes", "messages": [{"role": "user", "content": "say yes"}], "expected": "yes"},
    {"id": "no", "messages": [{"role": "user", "content": "say no"}], "expected": "no"},
]
PROMPT = [{"role": "user", "content": "say yes"}]
CONTAINS = {"type": "contains"}
SERVER_PACKAGES = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "torch", "art", "app")


def _upstream(live: LiveServer) -> str:
    return live.url.removeprefix("http://")


def _model(name: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "base_model": "tiny/base", "backend": "dry-run", "project": "tests"} | (
        {"config": config} if config else {}
    )


async def _training_jobs(live: LiveServer, model: str) -> list[dict[str, Any]]:
    page = (await live.client.get("/v1/training-jobs", params={"model": model})).json()
    return list(page["data"])


# --------------------------------------------------------------------------- packaging


def test_the_client_imports_and_runs_without_the_server_stack() -> None:
    """Imported with the server's packages made unimportable, the SDK and the CLI load,
    and the distribution asks for nothing of the server's (rich: for the CLI only)."""
    script = textwrap.dedent(
        f"""
        import sys

        BLOCKED = {SERVER_PACKAGES!r}

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError("blocked: " + name)
                return None

        sys.meta_path.insert(0, Block())
        import trainyard_client
        import trainyard_client.cli
        client = trainyard_client.Trainyard("http://127.0.0.1:9")
        assert client.openai_base_url == "http://127.0.0.1:9/openai/v1"
        try:
            trainyard_client.cli.main(["--help"])
        except SystemExit as exit:
            assert exit.code == 0
        loaded = {{name.split(".")[0] for name in sys.modules}}
        assert not loaded & set(BLOCKED), loaded & set(BLOCKED)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
    requires = importlib.metadata.requires("trainyard-client") or []

    def name(requirement: str) -> str:
        return re.split(r"[ <>=;\[]", requirement, maxsplit=1)[0].lower()

    # The SDK asks for httpx and pydantic; all else is an extra's: rich for the CLI, ART
    # (and openai) for the ART backend, NAT for its trainer adapter.
    extras: dict[str, set[str]] = {}
    for requirement in requires:
        extra = re.search(r'extra == "(\w+)"', requirement)
        extras.setdefault(extra.group(1) if extra else "", set()).add(name(requirement))
    assert extras == {
        "": {"httpx", "pydantic"},
        "cli": {"rich"},
        "art": {"openpipe-art", "openai"},
        "nat": {"nvidia-nat-core"},
    }, requires


# --------------------------------------------------------------------------- operations


def _operation_of(method: str, path: str) -> str:
    for operation, (want, template) in OPERATIONS.items():
        pattern = re.sub(r"\{[^}]+\}", "[^/]+", template)
        if method == want and re.fullmatch(pattern, path):
            return operation
    raise AssertionError(f"no operation for {method} {path}")


def _every_operation(url: str, tiny: Path, workdir: Path) -> set[str]:
    called: set[str] = set()
    http = httpx.Client(
        event_hooks={"request": [lambda r: called.add(_operation_of(r.method, r.url.path))]}
    )
    with http, Trainyard(url, http_client=http, retry=FAST) as client:
        assert client.health().status == "ok"
        assert client.ready().status == "ready"
        assert "trainyard_jobs" in client.metrics()
        backends = {b.name: b for b in client.backends.list()}
        assert "learning_rate" in backends["dry-run"].hyperparameters["properties"]

        model = client.models.create(**_model("sdk", seconds_per_step=0.05))
        assert (model.name, model.backend, model.current_step) == ("sdk", "dry-run", 0)
        assert client.models.create(**_model("sdk", seconds_per_step=0.05)) == model
        with pytest.raises(ConflictError):
            client.models.create(**_model("sdk", seconds_per_step=1.0))
        assert client.models.get("sdk") == model

        job = client.training_jobs.create(
            model="sdk", collection=f.nat_collection(), metadata={"source": "sdk"}
        )
        assert job.status == "queued" and job.summary.num_groups == 2
        done = client.training_jobs.wait(job.id, timeout=PATIENCE)
        assert done.status == "succeeded", done.error
        assert done.result is not None and done.result.final_step == 1
        listed = client.training_jobs.list(model="sdk", metadata={"source": "sdk"}, limit=5)
        assert [j.id for j in listed.data] == [job.id] and not listed.has_more
        assert [j.id for j in client.training_jobs.iterate(status="succeeded")] == [job.id]
        page = client.training_jobs.list_events(job.id, limit=2)
        assert [e.seq for e in page.data] == [1, 2] and page.has_more
        streamed = list(client.training_jobs.events(job.id, after=2))
        assert streamed[0].seq == 3 and streamed[-1].type == "training_ended"
        assert len(client.training_jobs.trajectories(job.id)["groups"]) == 2
        assert client.training_jobs.trajectories(job.id, shape="nat")["run_id"] == job.id
        with pytest.raises(ConflictError, match="already succeeded"):
            client.training_jobs.cancel(job.id)

        steps = [c.step for c in client.checkpoints.iterate("sdk", limit=1)]
        assert steps == [1, 0]
        assert client.checkpoints.get("sdk", 1).job_id == job.id
        assert client.aliases.set("sdk", "good", step=1).step == 1
        assert "good" in {a.alias for a in client.aliases.list("sdk").data}
        client.aliases.delete("sdk", "good")
        client.checkpoints.delete("sdk", 0)
        assert client.retention.set("sdk", keep_last=1).keep_last == 1
        assert client.retention.get("sdk").keep_last == 1
        assert client.retention.apply("sdk").kept == [1]
        client.retention.delete("sdk")
        with pytest.raises(ConflictError):  # a dry-run step has no adapter to export
            client.checkpoints.export("sdk", 1, workdir / "sdk.tar.gz")

        client.models.create(name="toy", base_model=str(tiny), backend="cpu")
        assert {m.name for m in client.models.iterate(limit=1)} == {"sdk", "toy"}
        rollout = client.rollout_jobs.create(
            model="toy",
            examples=EXAMPLES,
            num_generations=2,
            sampling={"max_tokens": 1},
            grader={"type": "contains"},
            train={"hyperparameters": {"learning_rate": 0.02}},
            metadata={"source": "sdk"},
        )
        rolled = client.rollout_jobs.wait(rollout.id, timeout=PATIENCE)
        assert rolled.status == "succeeded", rolled.error
        assert rolled.summary.num_graded == 4 and rolled.training_job_id is not None
        trained = client.training_jobs.wait(rolled.training_job_id, timeout=PATIENCE)
        assert trained.status == "succeeded", trained.error
        exported = workdir / "toy.zip"
        assert client.checkpoints.export("toy", 1, exported, format="zip") > 0
        assert exported.read_bytes().startswith(b"PK")
        merged = workdir / "toy-merged.tar"
        size = client.checkpoints.export("toy", 1, merged, format="merged")
        with tarfile.open(merged) as tar:  # the base with the step merged in
            names = tar.getnames()
        assert size == merged.stat().st_size
        assert {"toy-step0001-merged/config.json", "toy-step0001-merged/model.safetensors"} <= {
            *names
        }
        assert [r.id for r in client.rollout_jobs.list(model="toy").data] == [rollout.id]
        assert client.rollout_jobs.list_events(rollout.id).data[0].type == "job_queued"
        assert list(client.rollout_jobs.events(rollout.id))[-1].type == "rollout_ended"
        assert client.rollout_jobs.trajectories(rollout.id)["run_id"] == rollout.id
        with pytest.raises(ConflictError):
            client.rollout_jobs.cancel(rollout.id)

        grader = {"type": "contains"}
        before, after = (
            client.evaluations.create(
                model=f"toy@{step}", examples=EXAMPLES, grader=grader, sampling={"max_tokens": 1}
            )
            for step in (0, 1)
        )
        evaluated = [client.evaluations.wait(j.id, timeout=PATIENCE) for j in (before, after)]
        assert [e.status for e in evaluated] == ["succeeded", "succeeded"], evaluated
        assert [e.summary.step for e in evaluated] == [0, 1]
        answers = client.evaluations.results(after.id, limit=1)
        assert answers.has_more and answers.data[0].example == 0
        assert client.evaluations.summary(after.id).num_examples == len(EXAMPLES)
        compared = client.evaluations.compare(before.id, after.id)
        assert (compared.a_step, compared.b_step) == (0, 1)
        assert [e.id for e in client.evaluations.list(model="toy").data] == [after.id, before.id]
        assert client.evaluations.list_events(after.id).data[0].type == "job_queued"
        assert list(client.evaluations.events(after.id))[-1].type == "evaluation_ended"
        with pytest.raises(ConflictError):
            client.evaluations.cancel(after.id)

        lines = [{"id": f"t{i}", "messages": PROMPT, "expected": "yes"} for i in range(2)]
        lines.append({"id": "v", "messages": PROMPT, "expected": "yes", "split": "validation"})
        dataset = client.datasets.upload("sdk-set", lines)
        assert dataset.splits == {"train": 2, "validation": 1}
        assert client.datasets.upload("sdk-set", lines) == dataset  # stored once
        assert [d.id for d in client.datasets.list(name="sdk-set").data] == [dataset.id]
        assert client.datasets.get(dataset.id).num_examples == 3
        hook = client.webhooks.create(  # on a port that refuses: its attempts fail
            url="http://127.0.0.1:9/hook", event_types=["run.started", "run.succeeded"]
        )
        assert hook.secret.startswith("whsec_") and hook.enabled
        recipe = {"num_generations": 2, "sampling": {"max_tokens": 1}, "grader": CONTAINS}
        priced = client.runs.estimate(
            model="toy",
            dataset={"id": dataset.id},
            recipe=recipe,
            schedule={"max_steps": 1, "examples_per_step": 2},
        )
        assert (priced.total_steps, priced.samples) == (1, 2 * recipe["num_generations"])
        run = client.runs.create(
            model="toy",
            dataset={"id": dataset.id},
            recipe=recipe,
            schedule={"max_steps": 1, "examples_per_step": 2},
        )
        steps: list[Progress] = []
        ran = client.runs.wait(run.id, timeout=120, on_progress=steps.append)
        assert ran.status == "succeeded" and ran.progress.step == 1, ran.error
        # Its rollout's answers and its training step, as their final writes recorded them.
        assert ran.usage.completion_tokens and ran.usage.prompt_tokens
        assert ran.usage.trained_tokens and ran.usage.trained_tokens >= ran.usage.completion_tokens
        assert ran.cost.currency == "USD"
        assert (steps[-1].status, steps[-1].step, steps[-1].total) == ("succeeded", 1, 1)
        assert [r.kind for r in client.runs.metrics(run.id).data] == ["step"]
        settings = client.runs.settings(run.id)
        assert settings.schedule["max_steps"] == 1 and settings.recipe["num_generations"] == 2
        assert settings.num_train == 2 and settings.start_step is not None
        assert [r.id for r in client.runs.iterate(model="toy")] == [run.id]
        assert client.runs.list_events(run.id).data[0].type == "job_queued"
        assert list(client.runs.events(run.id))[-1].type == "run_ended"
        deliveries = client.webhooks.deliveries(hook.id, limit=10).data
        assert {(d.event_type, d.job_id) for d in deliveries} == {
            ("run.started", run.id),
            ("run.succeeded", run.id),
        }
        assert client.webhooks.test(hook.id).event_type == "webhook.test"
        assert [h.id for h in client.webhooks.list().data] == [hook.id]
        assert not client.webhooks.update(hook.id, enabled=False).enabled
        assert client.webhooks.get(hook.id).enabled is False
        moved = client.webhooks.update(
            hook.id, url="http://127.0.0.1:9/v2", event_types=["run.failed"]
        )
        assert (moved.url, moved.event_types, moved.enabled) == (
            "http://127.0.0.1:9/v2",
            ["run.failed"],
            False,
        )
        rotated = client.webhooks.rotate_secret(hook.id)
        assert rotated.secret.startswith("whsec_") and rotated.secret != hook.secret
        assert rotated.previous_secret_expires_at is not None
        assert rotated.secret_version == 2 and rotated.health.breaker == "closed"
        with pytest.raises(ConflictError):  # rotated meanwhile: version 2, not 1
            client.webhooks.rotate_secret(hook.id, if_match=1)
        assert client.webhooks.rotate_secret(hook.id, if_match=2).secret_version == 3
        client.webhooks.delete(hook.id)
        client.datasets.delete(dataset.id)
        long = client.runs.create(
            model="toy",
            examples=[{"id": 1, "messages": PROMPT, "expected": "yes"}],
            recipe=recipe,
            schedule={"max_steps": 50, "examples_per_step": 1},
        )
        assert client.runs.pause(long.id).paused
        assert not client.runs.resume(long.id).paused
        stopping = client.runs.cancel(long.id)  # queued: cancelled now; running: asked to
        assert stopping.status == "cancelled" or stopping.cancel_requested
        assert client.runs.wait(long.id, timeout=PATIENCE).status == "cancelled"

        assert "toy" in {m["id"] for m in client.gateway.models()["data"]}
        sampled = client.gateway.chat_completions(
            model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        assert sampled["model"].startswith("toy@") and len(sampled["choices"]) == 1
        assert client.openai_base_url == f"{url}/openai/v1"

        # Last: the in-process worker, listed, then drained (it stops claiming).
        [worker] = client.workers.list()
        assert worker.pool == "default" and "cpu" in worker.backends and not worker.draining
        drained = client.workers.drain(worker.id)
        assert drained.id == worker.id and drained.drain_requested_at is not None

        # A Tinker run's curves: `sdk` is no Tinker run (a model of project `tinker`).
        with pytest.raises(NotFoundError):
            client.models.tinker_metrics("sdk")

        # Projects and keys, last: once a key exists the server asks for one.
        project = client.projects.create(name="sdk-team")
        assert client.projects.get(project.id) == project
        assert project.id in {p.id for p in client.projects.list().data}
        capped = client.projects.set_quotas(project.id, running_jobs=2, queued_jobs=5)
        assert (capped.quotas.running_jobs, capped.quotas.submissions_per_minute) == (2, None)
        assert client.projects.get_quotas(project.id).usage.queued_jobs == 0
        spent = client.usage.get(group_by="model")
        assert spent.group_by == "model" and spent.total.jobs == sum(r.jobs for r in spent.data)
        assert "sdk" in {r.group for r in spent.data}  # its training job above ran
        made = client.projects.create_key(project.id, name="ops", scopes=["admin"])
        with Trainyard(url, http_client=http, retry=FAST, api_key=made.secret) as keyed:
            [listed_key] = keyed.projects.list_keys(project.id).data
            assert (listed_key.id, listed_key.scopes) == (made.id, ["admin"])
            audited = keyed.audit_events.list(project_id=project.id).data
            assert made.secret not in str([e.model_dump() for e in audited])
            keyed.projects.revoke_key(project.id, made.id)
    return called


@pytest.mark.torch
async def test_every_operation_against_a_live_server(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    tiny = await asyncio.to_thread(make_tiny_model, tmp_path / "models" / "tiny")
    async with serve(worker_enabled=True, model_roots=[tiny.parent]) as live:
        called = await asyncio.to_thread(_every_operation, live.url, tiny, tmp_path)
    assert called == set(OPERATIONS), set(OPERATIONS) - called


# --------------------------------------------------------------------------- retries


async def test_a_retried_submit_creates_exactly_one_job(serve: Callable[..., LiveServer]) -> None:
    """The first submit reaches the server and its answer is lost, the second gets a 503
    with Retry-After, the third a dropped connection: the fourth gets the job the first
    made, and the server holds one job."""
    async with serve(worker_enabled=True) as live:
        await f.create_model(live.client, "retried")
        plan = {
            ("POST", "/v1/training-jobs"): [DROP_AFTER, answer(503, "1"), DROP_BEFORE],
            ("GET", "/v1/models/retried"): [answer(429, "1"), DROP_BEFORE],
        }
        async with FaultyProxy(_upstream(live), plan) as proxy:

            def submit() -> tuple[Any, Any]:
                with Trainyard(proxy.url, retry=FAST) as client:
                    job = client.training_jobs.create(
                        model="retried", collection=f.nat_collection()
                    )
                    return job, client.models.get("retried")

            job, model = await asyncio.to_thread(submit)
            created = await _training_jobs(live, "retried")

    posts = proxy.requests("POST", "/v1/training-jobs")
    assert [p.action.kind for p in posts] == ["drop_after", "answer", "drop_before", "forward"]
    keys = {p.headers["idempotency-key"] for p in posts}
    assert len(keys) == 1 and next(iter(keys)).startswith("tyc-")
    assert posts[2].at - posts[1].at >= 1.0, "Retry-After: 1 was not honoured"
    assert [j["id"] for j in created] == [job.id], "a retried submit made a second job"
    gets = proxy.requests("GET", "/v1/models/retried")
    assert [g.action.kind for g in gets] == ["answer", "drop_before", "forward"]
    assert gets[1].at - gets[0].at >= 1.0
    assert model.name == "retried"


async def test_retries_stop_and_a_rollout_submit_is_resent_with_its_key(
    serve: Callable[..., LiveServer],
) -> None:
    async with serve() as live:
        await f.create_model(live.client, "plain")
        plan = {
            ("GET", "/v1/models/plain"): [answer(503, "0")] * 3,
            ("POST", "/v1/rollout-jobs"): [DROP_AFTER, answer(503, "0")],
        }
        async with FaultyProxy(_upstream(live), plan) as proxy:

            def calls() -> dict[str, Any]:
                errors: dict[str, Any] = {}
                body = {"model": "plain", "examples": EXAMPLES, "grader": {"type": "contains"}}
                with Trainyard(proxy.url, retry=RetryPolicy(max_retries=2, base_delay=0)) as c:
                    for name, call in {
                        "get": lambda: c.models.get("plain"),
                        "submit": lambda: c.rollout_jobs.create(**body),
                    }.items():
                        try:
                            call()
                        except Exception as exc:
                            errors[name] = exc
                return errors

            errors = await asyncio.to_thread(calls)

    unavailable = errors["get"]
    assert isinstance(unavailable, ServiceUnavailableError)
    assert unavailable.attempts == 3 and unavailable.retry_after == "0"
    assert unavailable.detail == "the proxy answered 503"
    # Its answer lost, then refused with a 503, a rollout submit is sent again with the
    # same Idempotency-Key; the server's own answer comes back.
    refused = errors["submit"]
    assert isinstance(refused, ValidationError) and refused.attempts == 3
    assert refused.paths == ["model"] and refused.errors[0].type == "not_served"
    posts = proxy.requests("POST", "/v1/rollout-jobs")
    assert [p.action.kind for p in posts] == ["drop_after", "answer", "forward"]
    keys = {p.headers["idempotency-key"] for p in posts}
    assert len(keys) == 1 and next(iter(keys)).startswith("tyc-")


async def test_a_resent_cancel_or_delete_whose_lost_first_copy_worked_succeeds(
    serve: Callable[..., LiveServer],
) -> None:
    """The answer to a cancel or a DELETE is lost after the server acted: the copy sent
    again meets the effect (409 already cancelled, 404 gone) and reports success."""
    async with serve() as live:  # no worker: the job stays queued until cancelled
        await f.create_model(live.client, "undo")
        job = (await f.submit(live.client, "undo")).json()
        plan = {
            ("POST", f"/v1/training-jobs/{job['id']}/cancel"): [DROP_AFTER],
            ("DELETE", "/v1/models/undo/retention"): [DROP_AFTER],
        }
        async with FaultyProxy(_upstream(live), plan) as proxy:

            def undo() -> tuple[Any, Any]:
                with Trainyard(proxy.url, retry=FAST) as client:
                    client.retention.set("undo", keep_last=2)
                    cancelled = client.training_jobs.cancel(job["id"])
                    return cancelled, client.retention.delete("undo")

            cancelled, deleted = await asyncio.to_thread(undo)
            policy = (await live.client.get("/v1/models/undo/retention")).json()

    assert cancelled.status == "cancelled" and deleted is None
    assert policy["keep_last"] is None  # no policy any more
    assert len(proxy.requests("POST", f"/v1/training-jobs/{job['id']}/cancel")) == 2
    assert len(proxy.requests("DELETE", "/v1/models/undo/retention")) == 2


# --------------------------------------------------------------------------- errors


async def test_problem_errors_carry_status_type_detail_and_field_paths(
    serve: Callable[..., LiveServer],
) -> None:
    async with serve(api_keys="sdk-key", max_body_bytes=50_000) as live:

        def failures() -> dict[str, Exception]:
            found: dict[str, Exception] = {}
            bad = f.nat_collection()
            bad["trajectories"][0][1]["episode"][2]["logprobs"] = None
            with Trainyard(live.url, api_key="sdk-key", retry=FAST) as client:
                client.models.create(**_model("errs"))
                job = client.training_jobs.create(
                    model="errs", collection=f.nat_collection(), idempotency_key="k-1"
                )
                again = client.training_jobs.create(
                    model="errs", collection=f.nat_collection(), idempotency_key="k-1"
                )
                assert again.id == job.id
                for name, call in {
                    "invalid": lambda: client.training_jobs.create(model="errs", collection=bad),
                    "reused": lambda: client.training_jobs.create(
                        model="errs", groups=f.art_groups(), idempotency_key="k-1"
                    ),
                    "missing": lambda: client.training_jobs.get("job_nope"),
                    "too_big": lambda: client.models.create(**_model("big", note="x" * 60_000)),
                }.items():
                    try:
                        call()
                    except Exception as exc:
                        found[name] = exc
            with Trainyard(live.url, api_key="wrong", retry=FAST) as stranger:
                try:
                    stranger.models.list()
                except Exception as exc:
                    found["key"] = exc
            return found

        found = await asyncio.to_thread(failures)
        async with AsyncTrainyard(live.url, api_key="sdk-key") as client:
            with pytest.raises(ValidationError) as refused:
                await client.rollout_jobs.create(model="errs", examples=[])

    invalid = found["invalid"]
    assert isinstance(invalid, ValidationError)
    assert (invalid.status, invalid.type) == (422, "urn:trainyard:problem:validation-error")
    assert invalid.paths == ["collection.trajectories[0][1].episode[2].logprobs"]
    assert invalid.errors[0].type == "missing_logprobs" and invalid.errors[0].location == "body"
    assert "collection.trajectories[0][1].episode[2].logprobs" in str(invalid)
    reused = found["reused"]
    assert isinstance(reused, ValidationError)
    assert reused.paths == ["header:idempotency-key"]
    missing = found["missing"]
    assert isinstance(missing, NotFoundError) and missing.status == 404
    assert missing.detail == "no training job 'job_nope'"
    assert missing.problem.instance == "/v1/training-jobs/job_nope"
    assert isinstance(found["too_big"], PayloadTooLargeError)
    assert isinstance(found["key"], AuthenticationError) and found["key"].status == 401
    assert "examples" in {p.split("[")[0] for p in refused.value.paths}


# --------------------------------------------------------------------------- events


async def test_wait_reconnects_from_the_last_event_it_received(
    serve: Callable[..., LiveServer],
) -> None:
    """The stream is cut twice mid-job: wait() reconnects with Last-Event-ID each time and
    sees every event once, in order."""
    async with serve(worker_enabled=True) as live:
        await f.create_model(live.client, "cut", seconds_per_step=0.5)
        rewards = [[1.0, 0.0], [0.5, 0.25], [1.0, 0.5], [0.0, 1.0]]
        job = (await f.submit(live.client, "cut", collection=f.nat_collection(rewards))).json()
        stream = f"/v1/training-jobs/{job['id']}/events/stream"
        plan = {("GET", stream): [cut_stream(2), cut_stream(2)]}
        async with FaultyProxy(_upstream(live), plan) as proxy:
            seen: list[Progress] = []

            def wait() -> Any:
                with Trainyard(proxy.url, retry=FAST) as client:
                    return client.training_jobs.wait(job["id"], on_progress=seen.append)

            done = await asyncio.to_thread(wait)

    assert done.status == "succeeded"
    seqs = [p.event.seq for p in seen]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    assert seen[-1].event.type == "training_ended" and seen[-1].done
    assert [(p.step, p.total) for p in seen if p.event.type == "gradient_step"] == [
        (1, 4),
        (2, 4),
        (3, 4),
        (4, 4),
    ]
    streams = proxy.requests("GET", stream)
    # Cut twice (a third stream, unless the second cut came with the job's last event).
    assert [s.action.kind for s in streams[:2]] == ["cut_stream", "cut_stream"]
    assert len(streams) in (2, 3), streams
    assert "last-event-id" not in streams[0].headers
    resumed = [int(s.headers["last-event-id"]) for s in streams[1:]]
    assert resumed == sorted(resumed) and resumed[0] >= 2 and set(resumed) <= set(seqs)


async def test_the_async_client_submits_once_and_follows_a_broken_stream(
    serve: Callable[..., LiveServer],
) -> None:
    async with serve(worker_enabled=True) as live:
        await f.create_model(live.client, "async", seconds_per_step=0.3)
        plan = {
            ("POST", "/v1/training-jobs"): [DROP_AFTER],
            ("GET", "/v1/training-jobs/job_"): [FORWARD, cut_stream(1)],
        }
        async with (
            FaultyProxy(_upstream(live), plan) as proxy,
            AsyncTrainyard(proxy.url, retry=FAST) as client,
        ):
            job = await client.training_jobs.create(model="async", groups=f.art_groups())
            seen: list[Progress] = []

            async def record(progress: Progress) -> None:
                seen.append(progress)

            done = await client.training_jobs.wait(job.id, on_progress=record)
            created = await _training_jobs(live, "async")

    assert [j["id"] for j in created] == [job.id]
    assert done.status == "succeeded" and done.result is not None
    assert [p.event.seq for p in seen] == list(range(1, len(seen) + 1))
    streams = proxy.requests("GET", f"/v1/training-jobs/{job.id}/events/stream")
    assert len(streams) == 2 and int(streams[1].headers["last-event-id"]) >= 1


async def test_wait_times_out_and_a_queued_job_cancels(serve: Callable[..., LiveServer]) -> None:
    async with serve() as live:  # no worker: the job stays queued
        await f.create_model(live.client, "idle")
        job = (await f.submit(live.client, "idle")).json()

        def wait_then_cancel() -> tuple[float, Any, Any]:
            with Trainyard(live.url, retry=FAST) as client:
                began = time.monotonic()
                with pytest.raises(WaitTimeoutError):
                    client.training_jobs.wait(job["id"], timeout=1.0)
                took = time.monotonic() - began
                cancelled = client.training_jobs.cancel(job["id"])
                return took, cancelled, client.training_jobs.wait(job["id"], timeout=10)

        took, cancelled, waited = await asyncio.to_thread(wait_then_cancel)
    assert 1.0 <= took < 10.0  # the 1 s timeout; the job would stay queued for ever
    assert cancelled.status == "cancelled" and waited.status == "cancelled"
