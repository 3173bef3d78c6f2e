"""Hostile input: schemathesis fuzzes every operation of the live OpenAPI document.

The service runs under uvicorn on 127.0.0.1 with an API key, its in-process worker and a
real database (SQLite, or Postgres when TRAINYARD_TEST_DATABASE_URL is set), in a thread of
this process. The `schemathesis run` CLI, in a subprocess, loads `/openapi.json` from it and
sends every operation examples, boundary and negative values (coverage), random data
(fuzzing) and chains of calls (stateful), over real HTTP, checking every response.

Before that, models and jobs in every state are made through the API; path parameters and
`model` fields are drawn from their names and ids half of the time, so operations reach
real rows and not only 404s. Rollouts need a served model: the dry-run trainer stands in for
the `cpu` backend and serves from a scripted OpenAI-compatible endpoint (no weights here).
Nothing leaves the machine: the worker's calls to generated webhook and agent URLs go
through the egress policy with only loopback allowed, and a resolver that resolves no name
but `localhost` (no DNS query leaves either); the sampling client's requests elsewhere go to
a proxy that refuses them.

The run takes about half a minute on two cores (plus the seeding).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from app import egress
from app.backends.dry_run import DryRunBackend
from app.main import create_app
from app.settings import Settings
from tests import factories
from tests.processes import PATIENCE

ROOT = str(Path(__file__).resolve().parents[1])
API_KEY = "fuzz-key"
SEED = 7_2024
MAX_EXAMPLES = 25  # per operation and phase
REQUEST_TIMEOUT = 10.0
# The event stream of a job that is still running stays open: read it until this many events
# came, or for STREAM_TIMEOUT seconds.
MAX_STREAM_EVENTS = 2
STREAM_TIMEOUT = 1.5
FINAL = {"succeeded", "failed", "cancelled"}
REJECTIONS = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]
HOLD = "hold"  # a prompt the sampler answers only when the test ends: a rollout stays running

# Checks: all of them ("checks.enabled"), so 5xx, undocumented status codes, content types,
# headers and bodies that break the schema, missing auth, bad methods and Allow headers,
# accepted invalid data all fail the run. One exception, per operation, below.
POSITIVE_DATA_ACCEPTANCE_OFF = {
    # `positive_data_acceptance` expects a 2xx for every schema-valid body. These bodies
    # carry rules JSON Schema cannot state, answered with 422 and the failing field's path:
    # the model must exist (and, for rollouts, be served); `config` and `hyperparameters`
    # must suit the model's backend; trajectories must be trainable (an assistant turn with
    # OpenAI logprobs, roles in order); example ids must be unique; an alias must name a
    # step whose checkpoint is on disk; a schedule needs `epochs` or `max_steps`; a webhook's
    # URL, registered or changed, must pass the egress policy (only loopback here). And
    # strict bodies take no `2.0` for an integer.
    "models-create",
    "training_jobs-create",
    "rollout_jobs-create",
    "runs-estimate",
    "webhooks-create",
    "webhooks-update",
    "checkpoints-set_alias",
    "checkpoints-set_retention",
    # A run's dataset must exist and hold the splits it names; a dataset's lines must each
    # be an example (a JSON Lines body is a string to the schema).
    "runs-create",
    "datasets-upload",
    # An evaluation's model must exist and sample, its step or alias too; a dataset's name
    # must name one, with the split.
    "evaluation_jobs-create",
    # A key's `expires_at` must be in the future.
    "projects-create_key",
    # A window's start must come before its end (`from` < `to`, `since` < `until`).
    "usage-get",
    "audit-list",
}


# ---------------------------------------------------------------------------------------------
# A served model for rollouts: the dry-run trainer, sampled from a scripted endpoint
# ---------------------------------------------------------------------------------------------


class _Completions(BaseHTTPRequestHandler):
    """`POST /v1/chat/completions`: `n` choices alternating "yes" and "no", with logprobs."""

    released: threading.Event

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if any(m.get("content") == HOLD for m in body.get("messages", [])):
            self.released.wait(600)
        choices = [
            {
                "index": i,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "no" if i % 2 else "yes"},
                "logprobs": factories.logprobs([19 + i % 2]),
            }
            for i in range(int(body.get("n", 1)))
        ]
        data = json.dumps({"id": "c", "object": "chat.completion", "choices": choices}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        return None


class ServedDryRun(DryRunBackend):
    """The dry-run trainer, whose models are served at `base_url`."""

    def __init__(self, path: Path, base_url: str) -> None:
        super().__init__(path)
        self.base_url = base_url

    async def _prepare_backend_for_training(
        self, model: Any, config: Any = None
    ) -> tuple[str, str]:
        return self.base_url, "sampler-key"


@dataclass
class Sampler:
    url: str
    released: threading.Event  # set: held requests are answered


@pytest.fixture
def sampler() -> Iterator[Sampler]:
    released = threading.Event()
    handler = type("Completions", (_Completions,), {"released": released})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Sampler(f"http://127.0.0.1:{server.server_address[1]}/v1", released)
    released.set()
    server.shutdown()
    server.server_close()


# ---------------------------------------------------------------------------------------------
# The service, in a thread
# ---------------------------------------------------------------------------------------------


class ErrorLog(logging.Handler):
    """ERROR records of the service: an exception after a stream's 200 went out shows only
    here, not in a status code."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self.records.append(text)


class ThreadedServer:
    def __init__(self, app: Any) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=0,
                log_level="warning",
                lifespan="on",
                timeout_graceful_shutdown=2,
            )
        )
        self.thread = threading.Thread(target=self.server.run, name="fuzzed-server", daemon=True)
        self.url = ""

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive(), "the server failed to start"
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@dataclass
class Seeded:
    models: list[str] = field(default_factory=list)
    training_jobs: list[str] = field(default_factory=list)
    rollout_jobs: list[str] = field(default_factory=list)
    evaluation_jobs: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)
    webhooks: list[str] = field(default_factory=list)


def _wait(client: httpx.Client, url: str, statuses: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + PATIENCE
    while True:
        job = client.get(url).json()
        if job["status"] in statuses:
            return dict(job)
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def seed(client: httpx.Client, data_dir: Path) -> Seeded:
    """Models on three backends, and jobs queued, running, succeeded, failed, cancelled."""
    seeded = Seeded()

    def model(name: str, backend: str = "dry-run", listed: bool = True, **config: Any) -> None:
        body = factories.model_body(name, backend, **config)
        if backend == "cpu":  # loads from the disk: a path under the data directory
            body["base_model"] = str((data_dir / "models" / "base").absolute())
        response = client.post("/v1/models", json=body)
        assert response.status_code == 201, response.text
        if listed:  # the fuzzer's dictionary (deterministic: its draws follow the list)
            seeded.models.append(name)

    def training(model: str, **body: Any) -> str:
        payload = {"model": model, **body}
        payload.setdefault("collection", factories.nat_collection())
        response = client.post("/v1/training-jobs", json=payload)
        assert response.status_code == 202, response.text
        seeded.training_jobs.append(response.json()["id"])
        return str(response.json()["id"])

    def rollout(*prompts: Any, **body: Any) -> str:
        examples = [
            {"id": i, "messages": [{"role": "user", "content": p}], "expected": "yes"}
            for i, p in enumerate(prompts)
        ]
        payload = {"model": "fuzz-served", "examples": examples, "num_generations": 2, **body}
        response = client.post("/v1/rollout-jobs", json=payload)
        assert response.status_code == 202, response.text
        seeded.rollout_jobs.append(response.json()["id"])
        return str(response.headers["location"])

    # A webhook endpoint for every event, on a loopback port that refuses: the jobs below
    # leave it deliveries with failed attempts in its log.
    hook = client.post(
        "/v1/webhooks",
        json={
            "url": "http://127.0.0.1:9/hook",
            "event_types": ["job.succeeded", "job.failed", "job.cancelled", "run.succeeded"],
        },
    )
    assert hook.status_code == 201, hook.text
    seeded.webhooks.append(hook.json()["id"])

    model("fuzz-dry")
    model("fuzz-failing", fail_with="the trainer refused")
    model("fuzz-slow", seconds_per_step=3600)
    model("fuzz-served", "cpu")

    done = training("fuzz-dry")
    training("fuzz-dry", collection=None, groups=factories.art_groups([[1.0, 0.0], [0.5]]))
    failed = training("fuzz-failing")
    slow = training("fuzz-slow")
    # One job per model at a time: these wait behind `slow` until a cancel (or the end).
    cancelled = training("fuzz-slow")
    training("fuzz-slow")
    training("fuzz-slow", collection=None, groups=factories.art_groups())
    parts = [{"type": "text", "text": "no"}, {"type": "text", "text": "?"}]  # OpenAI content parts
    finished = rollout("yes?", parts, grader={"type": "exact_match"}, train={})
    held = rollout(HOLD, grader={"type": "contains"})
    # Queued behind `held` until the test ends (one job per model): one the fuzzer may
    # cancel whatever ended before it starts.
    rollout("yes?", grader={"type": "contains"})

    _wait(client, f"/v1/training-jobs/{done}", {"succeeded"})
    _wait(client, f"/v1/training-jobs/{failed}", {"failed"})
    _wait(client, f"/v1/training-jobs/{slow}", {"running"})
    assert client.post(f"/v1/training-jobs/{cancelled}/cancel").json()["status"] == "cancelled"
    job = _wait(client, finished, FINAL)
    assert job["status"] == "succeeded", job
    seeded.training_jobs.append(job["training_job_id"])  # the rollout enqueued it
    _wait(client, held, {"running"})

    # A dataset, a run that ends, a paused one and two that go on.
    lines = [
        {"id": i, "messages": [{"role": "user", "content": "yes?"}], "expected": "yes", "split": s}
        for i, s in enumerate(["train", "train", "validation"])
    ]
    upload = client.post(
        "/v1/datasets?name=fuzz",
        content="\n".join(map(json.dumps, lines)),
        headers={"Content-Type": "application/jsonl"},
    )
    assert upload.status_code == 201, upload.text
    seeded.datasets.append(upload.json()["id"])
    model("fuzz-runs", "cpu")

    def run(model: str, steps: int = 1) -> str:
        body = {
            "model": model,
            "dataset": {"id": upload.json()["id"]},
            "recipe": {"num_generations": 2, "grader": {"type": "exact_match"}},
            "schedule": {"max_steps": steps, "examples_per_step": 2},
            "validation": {"every_steps": 1, "num_generations": 1},
        }
        response = client.post("/v1/runs", json=body)
        assert response.status_code == 202, response.text
        seeded.runs.append(response.json()["id"])
        return str(response.headers["location"])

    ended = run("fuzz-runs")
    assert _wait(client, ended, FINAL)["status"] == "succeeded"
    # Two evaluations of the same examples, succeeded: answers to page, a pair to compare.
    for step in ("fuzz-runs@0", "fuzz-runs"):
        evaluation = client.post(
            "/v1/evaluation-jobs",
            json={
                "model": step,
                "dataset": {"id": upload.json()["id"], "split": "validation"},
                "grader": {"type": "exact_match"},
                "samples_per_example": 2,
                "sampling": {"max_tokens": 1},
            },
        )
        assert evaluation.status_code == 202, evaluation.text
        seeded.evaluation_jobs.append(evaluation.json()["id"])
        location = evaluation.headers["location"]
        assert _wait(client, location, FINAL)["status"] == "succeeded"
    # And one that waits behind `held` (one job per model): one to cancel.
    waiting = client.post(
        "/v1/evaluation-jobs",
        json={
            "model": "fuzz-served",
            "examples": [{"id": 1, "messages": [{"role": "user", "content": "yes?"}]}],
            "grader": {"type": "regex", "pattern": "yes"},
        },
    )
    assert waiting.status_code == 202, waiting.text
    seeded.evaluation_jobs.append(waiting.json()["id"])
    # Long runs that stay: one paused (the fuzzer pauses and resumes them), and the one the
    # fuzzer may cancel (last).
    # (on a model of its own: `fuzz-runs` stays free for the runs the fuzzer submits)
    model("fuzz-paused", "cpu", listed=False)
    paused = run("fuzz-paused", steps=10_000)
    assert client.post(f"{paused}/pause").status_code == 200
    # One active run per model, and none beside a training job (the one `finished`
    # enqueued on `fuzz-served` waits behind `held`): the last two on models of their own.
    # Paused at once (the fuzzer may resume them): no rollout of theirs holds a worker's
    # slot, which the jobs the fuzzer submits need.
    for name in ("fuzz-runs-2", "fuzz-runs-3"):
        model(name, "cpu", listed=False)
        location = run(name, steps=10_000)
        assert client.post(f"{location}/pause").status_code == 200
    # The documented example of a run names the model `demo`.
    model("demo", "cpu")
    # A model of project `tinker`, as a Tinker training run is: its curves (none yet).
    tinker_run = factories.model_body("fuzz-tinker", "dry-run") | {"project": "tinker"}
    assert client.post("/v1/models", json=tinker_run).status_code == 201
    seeded.models.append("fuzz-tinker")

    collection = client.get(f"{finished}/trajectories")
    assert collection.status_code == 200, collection.text
    episodes = [t["episode"] for group in collection.json()["trajectories"] for t in group]
    assert {e[0]["content"] for e in episodes} == {"yes?", "no\n?"}  # the parts' text
    assert {e[-1]["metadata"]["finish_reason"] for e in episodes} == {"stop"}

    # Each documented request example is a valid request, given a model it suits.
    model("fuzz-sampled", "cpu", listed=False)
    document = client.get("/openapi.json").json()
    for path, suits in [
        ("/v1/models", None),
        ("/v1/training-jobs", "fuzz-dry"),
        ("/v1/rollout-jobs", "fuzz-sampled"),  # it trains: a model no run owns
        ("/v1/runs", "demo"),
        ("/v1/evaluation-jobs", "fuzz-runs"),
    ]:
        ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        # A body of several shapes (a training job's, by `method`): its first, the default.
        schema = ref["schema"]["oneOf"][0] if "oneOf" in ref["schema"] else ref["schema"]
        name = schema["$ref"].rsplit("/", 1)[-1]
        [example] = document["components"]["schemas"][name]["examples"]
        response = client.post(path, json=example | ({"model": suits} if suits else {}))
        assert response.status_code in (201, 202), f"{path}: {response.text}"
        created = response.json()
        if path == "/v1/models":
            seeded.models.append(created["name"])
        elif path == "/v1/training-jobs":
            seeded.training_jobs.append(created["id"])
        elif path == "/v1/evaluation-jobs":
            seeded.evaluation_jobs.append(created["id"])
        elif path == "/v1/runs":
            seeded.runs.insert(0, created["id"])
            # Ended, so `demo` takes the fuzzer's own run of the example (one run per model).
            cancel = client.post(f"/v1/runs/{created['id']}/cancel")
            assert cancel.status_code in (200, 409), cancel.text  # 409: it ended already
            _wait(client, f"/v1/runs/{created['id']}", FINAL)
        else:
            seeded.rollout_jobs.append(created["id"])  # queued behind `held`
    return seeded


def seed_checkpoints(client: httpx.Client, data_dir: Path) -> None:
    """Checkpoints with an adapter to export (the dry-run trainer writes none: files as the
    cpu backend saves them), step 0 of each model kept by an alias, and a retention policy
    (that keeps them all)."""
    for checkpoint in data_dir.glob("*/tests/models/*/checkpoints/[0-9]*"):
        (checkpoint / "adapter_config.json").write_text('{"peft_type": "LORA"}')
        (checkpoint / "adapter_model.safetensors").write_bytes(b"\0" * 64)
        if checkpoint.name == "0000":
            name = checkpoint.parent.parent.name
            alias = client.put(f"/v1/models/{name}/aliases/seeded", json={"step": 0})
            assert alias.status_code == 201, alias.text
    policy = client.put("/v1/models/fuzz-dry/retention", json={"keep_last": 1000})
    assert policy.status_code == 201, policy.text


def cancel_unfinished(client: httpx.Client) -> None:
    for kind in ("runs", "training-jobs", "rollout-jobs", "evaluation-jobs"):
        for status in ("running", "queued"):
            page = client.get(f"/v1/{kind}", params={"status": status, "limit": 100}).json()
            for job in page["data"]:
                client.post(f"/v1/{kind}/{job['id']}/cancel")


async def loopback_resolver(host: str, port: int) -> list[str]:
    if host.lower().rstrip(".") == "localhost":
        return ["127.0.0.1"]
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


@pytest.fixture
def no_egress(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Generated bodies name webhook graders and agents at any URL, and the worker calls
    them: resolve no name but `localhost` (the server's settings allow only loopback), and
    send every other HTTP request not to loopback to a proxy that refuses connections."""
    monkeypatch.setattr(egress, "_system_resolver", loopback_resolver)
    with socket.socket() as refusing:
        refusing.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        proxy = f"http://127.0.0.1:{refusing.getsockname()[1]}"
        for name in ("http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.setenv(name, proxy)
            monkeypatch.setenv(name.upper(), proxy)
        monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        yield


@pytest.fixture
def fuzzed_server(
    database_url: str, tmp_path: Path, sampler: Sampler, no_egress: None
) -> Iterator[tuple[str, Seeded, ErrorLog]]:
    settings = Settings(
        database_url=database_url,
        data_dir=tmp_path / "data",
        api_keys=API_KEY,  # type: ignore[arg-type]  # parsed like TRAINYARD_API_KEYS
        worker_enabled=True,
        heartbeat_seconds=0.5,
        lease_seconds=5.0,
        poll_seconds=0.5,
        retry_base_seconds=0.05,
        max_body_bytes=1024 * 1024,
        egress_allow=["loopback"],
    )
    served = ServedDryRun(tmp_path / "data" / "served", sampler.url)
    server = ThreadedServer(create_app(settings, backend_overrides={"cpu": served}))
    errors = ErrorLog()  # after uvicorn configured its loggers
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(errors)
    try:
        with server:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
                seeded = seed(client, settings.data_dir)
                seed_checkpoints(client, settings.data_dir)
                yield server.url, seeded, errors
                # A stopping worker gives running jobs 10 s to finish: end them now.
                sampler.released.set()
                cancel_unfinished(client)
    finally:
        for logger in loggers:
            logger.removeHandler(errors)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def schemathesis_config(seeded: Seeded) -> dict[str, Any]:
    operations: list[dict[str, Any]] = [
        {
            "include-operation-id": operation_id,
            "checks": {"positive_data_acceptance": {"enabled": False}},
        }
        for operation_id in sorted(POSITIVE_DATA_ACCEPTANCE_OFF)
    ]
    operations += [
        {"include-path-regex": "/events/stream$", "request-timeout": STREAM_TIMEOUT},
        {
            "include-tag": "training_jobs",
            "parameters": {
                "path.job_id": {"dictionary": "training_jobs", "probability": 0.5},
                "body.model": {"dictionary": "models", "probability": 0.5},
            },
        },
        {
            "include-tag": "rollout_jobs",
            "parameters": {"path.job_id": {"dictionary": "rollout_jobs", "probability": 0.5}},
        },
        {
            "include-tag": "evaluation_jobs",
            "parameters": {
                "path.job_id": {"dictionary": "evaluation_jobs", "probability": 0.5},
                "body.model": {"dictionary": "models", "probability": 0.5},
                "query.a": {"dictionary": "evaluations_compared", "probability": 0.5},
                "query.b": {"dictionary": "evaluations_compared", "probability": 0.5},
            },
        },
        {
            # Cancel only the run seeded for it: the others stay running to pause and resume.
            "include-operation-id": "runs-cancel",
            "parameters": {"path.run_id": {"dictionary": "run_to_cancel", "probability": 0.5}},
        },
        {
            "include-tag": "runs",
            "exclude-operation-id": "runs-cancel",
            "parameters": {
                "path.run_id": {"dictionary": "runs", "probability": 0.5},
                "path.job_id": {"dictionary": "runs", "probability": 0.5},
                "body.model": {"dictionary": "models", "probability": 0.5},
            },
        },
        {
            "include-tag": "datasets",
            "parameters": {"path.dataset_id": {"dictionary": "datasets", "probability": 0.5}},
        },
        {
            "include-tag": "webhooks",
            "parameters": {"path.endpoint_id": {"dictionary": "webhooks", "probability": 0.5}},
        },
        {
            # The seeded models' steps: 0 (aliased), 1 and 2 of `fuzz-dry` (deletable).
            "include-tag": "checkpoints",
            "parameters": {
                "path.step": {"dictionary": "steps", "probability": 0.5},
                # The model whose steps 1 and 2 may be deleted (more models than it are
                # seeded: drawn from all of them, a deletable step was seldom named).
                "path.name": {"dictionary": "checkpointed", "probability": 0.5},
            },
        },
    ]
    return {
        "seed": SEED,
        "cache": {"enabled": False},
        "headers": {"Authorization": f"Bearer {API_KEY}"},
        "request-timeout": REQUEST_TIMEOUT,
        "max-stream-events": MAX_STREAM_EVENTS,
        "continue-on-failure": True,
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        "checks": {
            "enabled": True,
            # An invalid body may also be too large (e.g. more items than `maxItems` allows
            # the fuzzer makes megabytes): 413 refuses it as surely as 422.
            "negative_data_rejection": {"expected-statuses": REJECTIONS},
        },
        "dictionaries": {
            "models": {"values": seeded.models},
            "training_jobs": {"values": seeded.training_jobs},
            "rollout_jobs": {"values": seeded.rollout_jobs},
            "evaluation_jobs": {"values": seeded.evaluation_jobs},
            "evaluations_compared": {"values": seeded.evaluation_jobs[:2]},
            "runs": {"values": seeded.runs},
            "run_to_cancel": {"values": seeded.runs[-1:]},
            "datasets": {"values": seeded.datasets},
            "webhooks": {"values": seeded.webhooks},
            "steps": {"values": [0, 1, 2, 3]},
            "checkpointed": {"values": ["fuzz-dry"]},
        },
        "parameters": {"path.name": {"dictionary": "models", "probability": 0.5}},
        "operations": operations,
    }


def _toml_value(value: Any) -> str:
    # JSON strings, numbers and arrays are valid TOML; objects become inline tables.
    if isinstance(value, dict):
        items = ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def to_toml(config: dict[str, Any]) -> str:
    lines = [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in config.items() if k != "operations"]
    for operation in config.get("operations", []):
        lines.append("\n[[operations]]")
        lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in operation.items()]
    return "\n".join(lines) + "\n"


def test_every_operation_survives_hostile_input(
    fuzzed_server: tuple[str, Seeded, ErrorLog], tmp_path: Path
) -> None:
    url, seeded, errors = fuzzed_server
    config = tmp_path / "schemathesis.toml"
    config.write_text(to_toml(schemathesis_config(seeded)))
    report = tmp_path / "report.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(config),
            "run",
            f"{url}/openapi.json",
            "--report",
            "json",
            "--report-json-path",
            str(report),
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
        env={**os.environ, "SCHEMATHESIS_HOOKS": "tests.fuzz_hooks", "PYTHONPATH": ROOT},
    )
    (tmp_path / "schemathesis.out").write_text(run.stdout + run.stderr)
    output = run.stdout[-30_000:] + run.stderr[-5_000:]
    if errors.records:
        output += "\n\nERROR records of the service:\n" + "\n".join(errors.records[:10])
    assert run.returncode == 0, output
    assert not errors.records, output

    result = json.loads(report.read_text())
    document = httpx.get(f"{url}/openapi.json").json()
    labels = {
        f"{method.upper()} {path}"
        for path, operations in document["paths"].items()
        for method in operations
    }
    assert result["operations"] == {
        "total": len(labels),
        "selected": len(labels),
        "tested": len(labels),
        "errored": 0,
        "skipped": 0,
        "skip_reasons": [],
    }
    assert {name: phase["status"] for name, phase in result["phases"].items()} == {
        "examples": "success",
        "coverage": "success",
        "fuzzing": "success",
        "stateful": "success",
    }
    assert result["failures"] == [] and result["errors"] == []
    # Every operation answered some generated request with a 2xx: the seeded rows were
    # reached, not only 404s and 422s.
    accepted = {
        label: sum(rate["accepted"] for rate in phases.values())
        for label, phases in result["valid_rates"].items()
    }
    never = sorted(label for label in labels if not accepted.get(label))
    assert never == [], json.dumps({label: result["valid_rates"].get(label) for label in never})
