"""The isolation matrix (issue 28 §2): every operation of the committed `openapi.json`,
called over real HTTP as each kind of caller, against one of each resource of project A.

The expected status of each cell is computed from rules over the document (the method,
the path's prefix, whether the path names a resource, the routes only an admin may use,
the open ones), so a new route is in the matrix the day it is added; one that no rule
covers (a path parameter with no resource to fill it, a body the test has no example of)
fails the test by name. One server, one database (SQLite or Postgres), one pass:

- no key, a revoked key, an expired key: 401 on every protected operation;
- a `read` key: 403 on anything but GET; a `sample` key: 403 outside the gateway, and
  every other key 403 at the gateway;
- a `write` key of project B: 404 for every path naming one of A's resources (exactly as
  for a missing one), A's models refused in a body as missing ones, lists without A's ids;
- A's own keys (and an admin key): never 401, 403 or 404 on A's resources.

No cell may be a 5xx. Calls that may change something and are allowed run last (changes
before deletes, a worker's drain the very last), so every other cell meets the seeded
resources as they were made."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import update

from app.db import create_engine
from app.models import ApiKeyRow
from tests.factories import model_body, nat_collection
from tests.processes import until
from tests.test_projects import ROOT, bearer, key, project
from tests.test_schema_fuzz import ServedDryRun, sampler  # noqa: F401  (a fixture)

DOCUMENT = json.loads((Path(__file__).resolve().parents[1] / "openapi.json").read_text())
METHODS = ("get", "put", "post", "patch", "delete")
ALLOWED = "allowed"  # not 401, 403 or 404 (nor 5xx): the caller reached the resource
REFUSED = "refused"  # a body naming another project's model: 404 or 422, as a missing one
LISTED = "listed"  # a read of a collection: 200, and none of A's ids in it
OTHERS = ("no key", "revoked", "expired", "a-read", "a-sample", "b-write", "b-sample")
CALLERS = ("a-write", "admin", *OTHERS)

# Operations only an admin may use: projects (but a project's own GET), keys, quotas (a
# project's own may read them), the audit log, changes to workers.
ADMIN_ONLY = [
    re.compile(r"^(post|get) /v1/projects$"),
    re.compile(r"^\w+ /v1/projects/\{project_id\}/keys"),
    re.compile(r"^put /v1/projects/\{project_id\}/quotas$"),
    re.compile(r"^\w+ /v1/audit-events"),
    re.compile(r"^(post|put|patch|delete) /v1/workers/"),
    re.compile(r"^get /metrics$"),  # every project's figures
]
GATEWAY = "/openai/"
# Every query that names a resource: as a path parameter does.
RESOURCE_QUERIES = {"get /v1/evaluation-jobs/compare": ("a", "b")}
# List filters that name one of A's resources: B's list, filtered so, is still without A's.
FILTERS = {"model": "a-roll", "name": "a-data"}
# Bodies that name a model (or dataset) of A: B is refused as for one that does not exist.
NAMES_A = {
    "post /v1/training-jobs",
    "post /v1/rollout-jobs",
    "post /v1/evaluation-jobs",
    "post /v1/runs",
    "post /v1/run-estimates",
    "post /openai/v1/chat/completions",
}
SAY = [{"role": "user", "content": "yes?"}]
EXAMPLES = [{"id": i, "messages": SAY, "expected": "yes"} for i in range(2)]


@dataclass
class Seed:
    project_a: str
    names: dict[str, str] = field(default_factory=dict)  # path parameter -> A's resource
    ids: set[str] = field(default_factory=set)  # every id of A a list may not show B
    compared: list[str] = field(default_factory=list)  # two evaluations: compare's a, b
    running: str = ""  # a job of A a worker runs now


def _ops() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in DOCUMENT["paths"].items():
        for method in METHODS:
            if method in item:
                yield method, path, item[method]


def _admin_only(method: str, path: str) -> bool:
    return any(rule.match(f"{method} {path}") for rule in ADMIN_ONLY)


def expected(method: str, path: str, op: dict[str, Any], who: str) -> str | int | None:
    """The rule for one cell; None: not called (an admin key changes only what only an
    admin may: A's own key makes every other change, and a delete happens once)."""
    if "security" not in op:  # open: /healthz, /readyz
        return ALLOWED
    if who in ("no key", "revoked", "expired"):
        return 401
    gateway = path.startswith(GATEWAY)
    if who.endswith("-sample") != gateway and who != "admin":
        return 403
    if who == "a-read" and method != "get":
        return 403
    if _admin_only(method, path):
        return ALLOWED if who == "admin" else 403
    if who == "admin":
        return ALLOWED if method == "get" else None
    if not who.startswith("b-"):
        return ALLOWED
    if "{" in path or f"{method} {path}" in RESOURCE_QUERIES:
        return 404
    if f"{method} {path}" in NAMES_A:
        return REFUSED
    return LISTED if method == "get" else ALLOWED


def _body(method: str, path: str, who: str, seed: Seed) -> dict[str, Any]:
    """What to send besides the path: a minimal valid body, or the query naming resources."""
    mark = who.replace(" ", "-")
    dataset = seed.names["dataset_id"]
    bodies: dict[str, dict[str, Any]] = {
        "post /v1/models": {"json": model_body(f"made-by-{mark}")},
        "put /v1/models/{name}/aliases/{alias}": {"json": {"step": int(seed.names["step"])}},
        "put /v1/models/{name}/retention": {"json": {"keep_last": 1000}},
        "post /v1/training-jobs": {"json": {"model": "a-dry", "collection": nat_collection()}},
        "post /v1/rollout-jobs": {
            "json": {"model": "a-roll", "examples": EXAMPLES, "grader": {"type": "exact_match"}}
        },
        "post /v1/evaluation-jobs": {
            "json": {"model": "a-roll", "examples": EXAMPLES, "grader": {"type": "exact_match"}}
        },
        "post /v1/runs": {"json": _run("a-roll", dataset)},
        "post /v1/run-estimates": {"json": _run("a-roll", dataset)},
        "post /v1/datasets": {
            "params": {"name": f"made-by-{mark}"},
            "content": DATASET,
            "headers": {"Content-Type": "application/jsonl"},
        },
        "post /v1/webhooks": {"json": HOOK},
        "patch /v1/webhooks/{endpoint_id}": {"json": {"enabled": True}},
        "post /v1/projects": {"json": {"name": f"made-by-{mark}"}},
        "post /v1/projects/{project_id}/keys": {"json": {"name": "k", "scopes": ["read"]}},
        "put /v1/projects/{project_id}/quotas": {"json": {}},  # no limits: changes nothing
        "post /openai/v1/chat/completions": {"json": {"model": "a-roll", "messages": SAY}},
    }
    cell = f"{method} {path}"
    if cell in RESOURCE_QUERIES:
        return {"params": dict(zip(RESOURCE_QUERIES[cell], seed.compared, strict=True))}
    return bodies.get(cell, {})


def _run(model: str, dataset: str) -> dict[str, Any]:
    return {
        "model": model,
        "dataset": {"id": dataset},
        "recipe": {"num_generations": 2, "grader": {"type": "exact_match"}},
        "schedule": {"max_steps": 1, "examples_per_step": 2},
    }


HOOK = {"url": "http://127.0.0.1:9/hook", "event_types": ["job.succeeded"]}
DATASET = "\n".join(
    json.dumps({"id": i, "messages": SAY, "expected": "yes", "split": s})
    for i, s in enumerate(["train", "train", "validation"])
)


def _fill(path: str, seed: Seed) -> str:
    """The path with A's resources in it; KeyError: a parameter no rule fills."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name == "name":
            return "a-tinker" if path.endswith("/tinker-metrics") else "a-dry"
        if name == "job_id":
            kind = path.split("/")[2]  # training-jobs, rollout-jobs, evaluation-jobs, runs
            return seed.names[kind]
        return seed.names[name]

    return re.sub(r"\{(\w+)\}", one, path)


def uncovered(seed: Seed) -> list[str]:
    """Operations no rule covers: a path parameter nothing fills, a body nothing gives."""
    missing = []
    for method, path, op in _ops():
        try:
            _fill(path, seed)
        except KeyError as exc:
            missing.append(f"{method.upper()} {path}: no resource for {exc}")
        if "requestBody" in op and not _body(method, path, "a-write", seed):
            missing.append(f"{method.upper()} {path}: no body")
    return missing


async def _seed(c: httpx.AsyncClient, a: dict[str, str], data_dir: Path) -> Seed:
    """One of each resource in project A, made by A's `write` key."""

    async def made(method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        answer = await c.request(method, path, headers=a | kwargs.pop("headers", {}), **kwargs)
        assert answer.status_code in (200, 201, 202), (path, answer.text)
        body: dict[str, Any] = answer.json()
        return body

    async def ended(path: str, statuses: set[str]) -> dict[str, Any]:
        async def done() -> dict[str, Any] | None:
            job: dict[str, Any] = (await c.get(path, headers=a)).json()
            return job if job["status"] in statuses else None

        return await until(done, timeout=60, what=f"{path} in {statuses}")

    seed = Seed(project_a="")
    for name, backend, extra in [
        ("a-dry", "dry-run", {}),
        ("a-slow", "dry-run", {"config": {"seconds_per_step": 3600}}),
        ("a-roll", "cpu", {}),
        ("a-tinker", "dry-run", {"project": "tinker"}),
    ]:
        body = model_body(name, backend) | extra
        if backend == "cpu":  # the served dry-run stands in for it; a path it may load
            body["base_model"] = str((data_dir / "models" / "base").absolute())
        await made("POST", "/v1/models", json=body)
    seed.names["endpoint_id"] = (await made("POST", "/v1/webhooks", json=HOOK))["id"]
    jobs = "/v1/training-jobs"
    trained = await made("POST", jobs, json={"model": "a-dry", "collection": nat_collection()})
    slow = await made("POST", jobs, json={"model": "a-slow", "collection": nat_collection()})
    seed.names["training-jobs"], seed.running = trained["id"], slow["id"]
    dataset = await made(
        "POST",
        "/v1/datasets",
        params={"name": "a-data"},
        content=DATASET,
        headers={"Content-Type": "application/jsonl"},
    )
    seed.names["dataset_id"] = dataset["id"]
    rollout = await made(
        "POST",
        "/v1/rollout-jobs",
        json={"model": "a-roll", "examples": EXAMPLES, "grader": {"type": "exact_match"}},
    )
    seed.names["rollout-jobs"] = rollout["id"]
    await ended(f"{jobs}/{trained['id']}", {"succeeded"})
    await ended(f"{jobs}/{slow['id']}", {"running"})
    await ended(f"/v1/rollout-jobs/{rollout['id']}", {"succeeded"})
    evaluations = []
    for _ in range(2):
        evaluation = await made(
            "POST",
            "/v1/evaluation-jobs",
            json={"model": "a-roll", "examples": EXAMPLES, "grader": {"type": "exact_match"}},
        )
        evaluations.append(evaluation["id"])
        await ended(f"/v1/evaluation-jobs/{evaluation['id']}", {"succeeded"})
    seed.names["evaluation-jobs"], seed.compared = evaluations[0], evaluations
    run = await made("POST", "/v1/runs", json=_run("a-roll", dataset["id"]))
    await ended(f"/v1/runs/{run['id']}", {"succeeded"})
    seed.names["runs"] = seed.names["run_id"] = run["id"]
    # A checkpoint of a-dry to show, export (files as the cpu backend saves them), alias.
    steps = (await c.get("/v1/models/a-dry/checkpoints", headers=a)).json()["data"]
    seed.names["step"] = str(steps[0]["step"])
    for checkpoint in data_dir.glob("*/tests/models/a-dry/checkpoints/[0-9]*"):
        (checkpoint / "adapter_config.json").write_text('{"peft_type": "LORA"}')
        (checkpoint / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    seed.names["alias"] = "kept"
    await made("PUT", "/v1/models/a-dry/aliases/kept", json={"step": int(seed.names["step"])})
    await made("PUT", "/v1/models/a-dry/retention", json={"keep_last": 1000})
    workers = (await c.get("/v1/workers", headers=a)).json()
    seed.names["worker_id"] = workers[0]["id"]
    seed.ids = {
        "a-dry",
        "a-slow",
        "a-roll",
        "a-tinker",
        trained["id"],
        slow["id"],
        rollout["id"],
        *evaluations,
        run["id"],
        dataset["id"],
        seed.names["endpoint_id"],
    }
    return seed


async def _call(
    c: httpx.AsyncClient, method: str, path: str, auth: dict[str, str], **extra: Any
) -> tuple[int, str, bytes]:
    """Status, content type and, but for an event stream (it may stay open), the body."""
    headers = auth | extra.pop("headers", {})
    request = c.build_request(method.upper(), path, headers=headers, **extra)
    answer = await c.send(request, stream=True)
    try:
        kind = answer.headers.get("content-type", "")
        body = b"" if kind.startswith("text/event-stream") else await answer.aread()
    finally:
        await answer.aclose()
    return answer.status_code, kind, body


def check(cell: str, rule: str | int, status: int, kind: str, body: bytes, seed: Seed) -> None:
    assert status < 500, (cell, status, body[:500])
    if rule == ALLOWED:
        assert status not in (401, 403, 404), (cell, status, body[:500])
    elif rule == REFUSED:
        assert status in (404, 422), (cell, status, body[:500])
        if "/openai/" in cell:  # OpenAI's envelope: no such model
            assert json.loads(body)["error"]["code"] == "model_not_found", (cell, body)
            return
        where = [e.get("path", "") for e in json.loads(body).get("errors", [])]
        assert any(w == "model" or w.startswith("dataset") for w in where), (cell, body)
    elif rule == LISTED:
        assert status == 200, (cell, status, body[:500])
        text = body.decode()
        leaked = sorted(i for i in seed.ids if i in text)
        assert not leaked, (cell, leaked)
    else:
        assert status == rule, (cell, status, body[:500])
        if status in (401, 403, 404) and "/openai/" not in cell:
            assert kind == "application/problem+json", (cell, kind)


def _filters(op: dict[str, Any]) -> dict[str, str]:
    query = [p["name"] for p in op.get("parameters", []) if p["in"] == "query"]
    return {name: FILTERS[name] for name in query if name in FILTERS}


def _order(cell: tuple[str, str, str]) -> tuple[int, str, str, str]:
    """Reads first; then changes; deletes after them; a worker's drain the very last."""
    method, path, who = cell
    rank = {"get": 0, "delete": 2}.get(method, 1) + (2 if path.endswith("/drain") else 0)
    return rank, path, method, who


HOOKED = {
    "api_keys": "root",
    "key_cache_seconds": 0,
    "worker_enabled": True,
    "worker_concurrency": 4,
}


async def test_every_operation_as_every_caller(
    serve: Callable[..., Any],
    sampler: Any,  # noqa: F811
    tmp_path: Path,
    database_url: str,
) -> None:
    served = ServedDryRun(tmp_path / "data" / "served", sampler.url)
    async with serve(backend_overrides={"cpu": served}, **HOOKED) as live:
        c = live.client
        pa, pb = await project(c, "a"), await project(c, "b")
        a_write = bearer((await key(c, pa, "write"))["secret"])
        seed = await _seed(c, a_write, tmp_path / "data")
        seed.project_a = seed.names["project_id"] = pa
        revoked = await key(c, pa, "write")
        assert (await c.delete(f"/v1/projects/{pa}/keys/{revoked['id']}", headers=ROOT)).is_success
        seed.names["key_id"] = revoked["id"]
        soon = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        expired = await key(c, pa, "write", expires_at=soon)
        engine = create_engine(database_url)
        try:
            async with engine.begin() as conn:  # the API refuses a past expiry: the hour passes
                await conn.execute(
                    update(ApiKeyRow.__table__)
                    .where(ApiKeyRow.__table__.c.id == expired["id"])
                    .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
                )
        finally:
            await engine.dispose()
        callers = {
            "a-write": a_write,
            "admin": bearer((await key(c, pb, "admin"))["secret"]),
            "no key": {},
            "revoked": bearer(revoked["secret"]),
            "expired": bearer(expired["secret"]),
            "a-read": bearer((await key(c, pa, "read"))["secret"]),
            "a-sample": bearer((await key(c, pa, "sample"))["secret"]),
            "b-write": bearer((await key(c, pb, "write"))["secret"]),
            "b-sample": bearer((await key(c, pb, "sample"))["secret"]),
        }
        assert uncovered(seed) == [], "operations no rule of the matrix covers"

        async def stored() -> dict[str, list[str]]:
            ids = {}
            for kind in ("training-jobs", "rollout-jobs", "evaluation-jobs", "runs"):
                page = (await c.get(f"/v1/{kind}", params={"limit": 100}, headers=ROOT)).json()
                ids[kind] = sorted(item["id"] for item in page["data"])
            return ids

        before = await stored()
        ops = {(m, p): op for m, p, op in _ops()}
        cells = [
            (m, p, who)
            for (m, p), op in ops.items()
            for who in CALLERS
            if expected(m, p, op, who) is not None
        ]
        refusals = [
            cell
            for cell in cells
            if expected(*cell[:2], ops[cell[:2]], cell[2]) not in (ALLOWED, LISTED)
        ]
        allowed = sorted(set(cells) - set(refusals), key=_order)
        try:
            for method, path, who in [*refusals, *allowed]:
                rule = expected(method, path, ops[(method, path)], who)
                status, kind, body = await _call(
                    c, method, _fill(path, seed), callers[who], **_body(method, path, who, seed)
                )
                check(f"{method.upper()} {path} as {who}", rule, status, kind, body, seed)
                if rule == LISTED and (filters := _filters(ops[(method, path)])):
                    status, kind, body = await _call(c, method, path, callers[who], params=filters)
                    check(f"GET {path}?{filters} as {who}", rule, status, kind, body, seed)
                if (method, path, who) == refusals[-1]:
                    # Every refusal is made: none stored a job or run.
                    assert await stored() == before
        finally:
            await c.post(f"/v1/training-jobs/{seed.running}/cancel", headers=ROOT)
        print(f"\n{len(cells)} cells: {len(refusals)} refusals, {len(allowed)} allowed")


async def test_open_routes_outside_the_document_need_no_key(serve: Callable[..., Any]) -> None:
    async with serve(api_keys="root") as live:
        for path in ("/openapi.json", "/dashboard/", "/docs"):
            assert (await live.client.get(path)).status_code == 200, path
        assert (await live.client.get("/v1/models")).status_code == 401


def test_an_operation_no_rule_covers_is_named(monkeypatch: Any) -> None:
    """A new route whose path names something the matrix cannot fill, or whose body it has
    no example of, fails the matrix by name instead of passing untested."""
    seed = Seed(project_a="p", names={"dataset_id": "ds", "step": "1"}, compared=["e1", "e2"])
    paths = dict(DOCUMENT["paths"])
    paths["/v1/things/{thing_id}"] = {"post": {"security": [], "requestBody": {}}}
    monkeypatch.setitem(DOCUMENT, "paths", paths)
    missing = uncovered(seed)
    assert "POST /v1/things/{thing_id}: no resource for 'thing_id'" in missing
    assert "POST /v1/things/{thing_id}: no body" in missing
