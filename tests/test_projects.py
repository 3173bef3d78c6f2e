"""Projects, project keys stored hashed, scopes at the edge, and the audit log (issue 28
§1 and §5), over real HTTP on both dialects. Key caches are set to 0 seconds where a test
needs a change seen at once: the cache's time is a setting, never a sleep here."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import insert, select, text, update

from app.db import create_engine
from app.models import DEFAULT_PROJECT_ID, ApiKeyRow, AuditEventRow
from app.tenants import audit
from tests.factories import model_body

ROOT = {"Authorization": "Bearer root"}
FRESH = {"api_keys": "root", "key_cache_seconds": 0}


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def project(client: httpx.AsyncClient, name: str) -> str:
    response = await client.post("/v1/projects", json={"name": name}, headers=ROOT)
    assert response.status_code == 201, response.text
    assert response.headers["location"] == f"/v1/projects/{response.json()['id']}"
    return str(response.json()["id"])


async def key(
    client: httpx.AsyncClient, project_id: str, *scopes: str, **extra: Any
) -> dict[str, Any]:
    response = await client.post(
        f"/v1/projects/{project_id}/keys",
        json={"name": "k", "scopes": list(scopes), **extra},
        headers=ROOT,
    )
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


async def until(check: Callable[[], Any], what: str) -> None:
    for _ in range(600):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def test_projects_keys_and_what_is_stored_of_a_secret(serve, database_url: str) -> None:
    async with serve(**FRESH) as live:
        c = live.client
        first = await project(c, "team-a")
        listed = (await c.get("/v1/projects", headers=ROOT)).json()
        assert [p["name"] for p in listed["data"]] == ["default", "team-a"] or [
            p["name"] for p in listed["data"]
        ] == ["team-a", "default"]
        assert DEFAULT_PROJECT_ID in {p["id"] for p in listed["data"]}
        taken = await c.post("/v1/projects", json={"name": "team-a"}, headers=ROOT)
        assert taken.status_code == 409
        made = await key(c, first, "write")
        secret = made["secret"]
        assert re.fullmatch(r"ty_[A-Za-z0-9_-]{43}", secret)
        assert made["prefix"] == secret[:10] and made["scopes"] == ["write"]
        # The form the Tinker SDK takes (it refuses keys without `tml-`) is the same key.
        assert made["tinker_api_key"] == f"tml-{secret}"
        as_tinker = await c.get("/v1/models", headers=bearer(made["tinker_api_key"]))
        assert as_tinker.status_code == 200, as_tinker.text
        assert (await c.get("/v1/models", headers=bearer(f"tml-{secret}x"))).status_code == 401
        keys = (await c.get(f"/v1/projects/{first}/keys", headers=ROOT)).json()["data"]
        assert [k["id"] for k in keys] == [made["id"]]
        assert "secret" not in keys[0] and "tinker_api_key" not in keys[0]
        # The key works, reads its own project, and not another's nor the list.
        assert (await c.get("/v1/models", headers=bearer(secret))).status_code == 200
        own = await c.get(f"/v1/projects/{first}", headers=bearer(secret))
        assert own.status_code == 200 and own.json()["name"] == "team-a"
        other = await c.get(f"/v1/projects/{DEFAULT_PROJECT_ID}", headers=bearer(secret))
        assert other.status_code == 404
        everything = await c.get("/v1/projects", headers=bearer(secret))
        assert everything.status_code == 403
        assert everything.json()["missing_scope"] == "admin"
        making = await c.post(
            f"/v1/projects/{first}/keys",
            json={"name": "x", "scopes": ["admin"]},
            headers=bearer(secret),
        )
        assert making.status_code == 403
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            row = (await conn.execute(select(ApiKeyRow.__table__))).one()
            dump = " ".join(str(value) for value in row)
    finally:
        await engine.dispose()
    assert row.secret_sha256 == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in dump and secret[10:] not in dump


async def test_bad_input_is_refused_naming_each_field_and_nothing_is_stored(serve) -> None:
    async with serve(**FRESH) as live:
        c = live.client
        bad = await c.post("/v1/projects", json={"name": "", "extra": 1}, headers=ROOT)
        assert bad.status_code == 422
        assert bad.headers["content-type"] == "application/problem+json"
        assert {e["path"] for e in bad.json()["errors"]} == {"name", "extra"}
        pid = await project(c, "p")
        past = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
        for body, paths in [
            ({"name": "k", "scopes": ["root", "read"]}, {"scopes[0]"}),
            ({"name": "k", "scopes": []}, {"scopes"}),
            ({"scopes": ["read"]}, {"name"}),
            ({"name": "k", "scopes": ["read"], "expires_at": past}, {"expires_at"}),
            (
                {"name": "k", "scopes": ["read"], "expires_at": "2030-01-01T00:00:00"},
                {"expires_at"},
            ),
        ]:
            answer = await c.post(f"/v1/projects/{pid}/keys", json=body, headers=ROOT)
            assert answer.status_code == 422, (body, answer.text)
            assert {e["path"] for e in answer.json()["errors"]} == paths, answer.json()
        missing = await c.post(
            "/v1/projects/proj_nope/keys", json={"name": "k", "scopes": ["read"]}, headers=ROOT
        )
        assert missing.status_code == 404
        assert missing.json()["errors"][0] == {
            "location": "path",
            "path": "project_id",
            "message": "no project 'proj_nope'",
            "type": "not_found",
        }
        keys = await c.get(f"/v1/projects/{pid}/keys", headers=ROOT)
        assert keys.json()["data"] == []
        # Keys exist only as env keys: a request without a key is still refused.
        assert (await c.get("/v1/models")).status_code == 401


async def test_a_revoked_key_is_refused_by_every_replica(serve, make_settings) -> None:
    async with serve(**FRESH) as a, serve(**FRESH) as b:
        pid = await project(a.client, "p")
        made = await key(a.client, pid, "read")
        assert (await b.client.get("/v1/models", headers=bearer(made["secret"]))).status_code == 200
        gone = await a.client.delete(f"/v1/projects/{pid}/keys/{made['id']}", headers=ROOT)
        assert gone.status_code == 204
        again = await a.client.delete(f"/v1/projects/{pid}/keys/{made['id']}", headers=ROOT)
        assert again.status_code == 204
        for live in (a, b):
            refused = await live.client.get("/v1/models", headers=bearer(made["secret"]))
            assert refused.status_code == 401
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.headers["www-authenticate"] == "Bearer"
        listed = (await a.client.get(f"/v1/projects/{pid}/keys", headers=ROOT)).json()
        assert listed["data"][0]["revoked_at"] is not None
        wrong = await a.client.delete(
            f"/v1/projects/{DEFAULT_PROJECT_ID}/keys/{made['id']}", headers=ROOT
        )
        assert wrong.status_code == 404
        assert wrong.json()["errors"][0]["path"] == "key_id"


async def test_an_expired_key_is_refused(serve, database_url: str) -> None:
    async with serve(**FRESH) as live:
        c = live.client
        pid = await project(c, "p")
        soon = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        made = await key(c, pid, "read", expires_at=soon)
        assert made["expires_at"] is not None
        assert (await c.get("/v1/models", headers=bearer(made["secret"]))).status_code == 200
        engine = create_engine(database_url)
        try:
            async with engine.begin() as conn:  # the hour passes
                await conn.execute(
                    update(ApiKeyRow.__table__)
                    .where(ApiKeyRow.__table__.c.id == made["id"])
                    .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
                )
        finally:
            await engine.dispose()
        assert (await c.get("/v1/models", headers=bearer(made["secret"]))).status_code == 401


async def test_scopes_are_checked_at_the_edge(serve) -> None:
    async with serve(**FRESH) as live:
        c = live.client
        pid = await project(c, "p")
        read = (await key(c, pid, "read"))["secret"]
        sample = (await key(c, pid, "sample"))["secret"]
        write = (await key(c, pid, "write"))["secret"]
        refused = await c.post("/v1/models", json=model_body("m1"), headers=bearer(read))
        assert refused.status_code == 403
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["missing_scope"] == "write"
        assert "write" in refused.json()["detail"]
        assert (await c.head("/v1/models", headers=bearer(read))).status_code == 200
        outside = await c.get("/v1/models", headers=bearer(sample))
        assert outside.status_code == 403 and outside.json()["missing_scope"] == "read"
        assert (await c.get("/openai/v1/models", headers=bearer(sample))).status_code == 200
        gateway = await c.get("/openai/v1/models", headers=bearer(read))
        assert gateway.status_code == 403
        assert gateway.json()["error"]["code"] == "missing_scope"
        unknown = await c.get("/openai/v1/models", headers=bearer("ty_" + "x" * 43))
        assert unknown.status_code == 401 and unknown.json()["error"]["code"] == "invalid_api_key"
        made = await c.post("/v1/models", json=model_body("m1"), headers=bearer(write))
        assert made.status_code == 201, made.text
        assert (await c.post("/v1/workers/w/drain", headers=bearer(write))).status_code == 403
        assert (await c.get("/v1/audit-events", headers=bearer(write))).status_code == 403
        # The env key is still an admin key.
        assert (await c.get("/v1/audit-events", headers=ROOT)).status_code == 200


async def test_open_until_a_key_exists_in_the_database(serve) -> None:
    async with serve(key_cache_seconds=0) as live:
        c = live.client
        assert (await c.get("/v1/models")).status_code == 200  # no key anywhere: open
        pid = await project_open(c, "p")
        made = (
            await c.post(f"/v1/projects/{pid}/keys", json={"name": "k", "scopes": ["admin"]})
        ).json()
        assert (await c.get("/v1/models")).status_code == 401
        admin = bearer(made["secret"])
        assert (await c.get("/v1/projects", headers=admin)).status_code == 200
        assert (
            await c.delete(f"/v1/projects/{pid}/keys/{made['id']}", headers=admin)
        ).status_code == 204
        assert (await c.get("/v1/models")).status_code == 200  # none left: open again


async def project_open(client: httpx.AsyncClient, name: str) -> str:
    response = await client.post("/v1/projects", json={"name": name})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def test_last_used_at_is_written_off_the_request_path(serve) -> None:
    async with serve(**FRESH, key_last_used_seconds=0) as live:
        c = live.client
        pid = await project(c, "p")
        made = await key(c, pid, "read")
        assert made["last_used_at"] is None
        assert (await c.get("/v1/models", headers=bearer(made["secret"]))).status_code == 200

        async def used() -> bool:
            keys = (await c.get(f"/v1/projects/{pid}/keys", headers=ROOT)).json()["data"]
            return keys[0]["last_used_at"] is not None

        await until(used, "last_used_at written")


async def test_a_change_is_in_the_audit_log_before_its_answer_ends(
    serve, database_url: str
) -> None:
    """The event is queued before the answer's last byte is sent, so a client that reads the
    log as soon as an answer is in finds it there, however late the server's own task goes on
    after the send. Here the log is read from inside the last send of each answer."""
    async with serve(**FRESH) as live:
        found: dict[str, list[tuple[str, int]]] = {}

        async def call(path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> int:
            status = 0

            async def receive() -> dict[str, Any]:
                return {"type": "http.request", "body": body, "more_body": False}

            async def send(message: dict[str, Any]) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                elif not message.get("more_body", False):
                    page = await live.client.get("/v1/audit-events", headers=ROOT)
                    found[path] = [(e["route"], e["status"]) for e in page.json()["data"]]

            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": path,
                "raw_path": path.encode(),
                "root_path": "",
                "query_string": b"",
                "headers": [(b"content-type", b"application/json"), *headers],
                "client": ("127.0.0.1", 50000),
                "server": ("127.0.0.1", 80),
            }
            await live.app(scope, receive, send)
            return status

        json_ = [(b"host", b"127.0.0.1")]
        assert (
            await call(
                "/v1/projects", b'{"name": "p"}', [*json_, (b"authorization", b"Bearer root")]
            )
            == 201
        )
        assert await call("/v1/models", b"{}", json_) == 401
        assert found["/v1/projects"][0] == ("/v1/projects", 201)
        assert found["/v1/models"][0] == ("/v1/models", 401)


async def test_every_change_is_audited_without_a_secret(serve, database_url: str) -> None:
    async with serve(**FRESH) as live:
        c = live.client
        pid = await project(c, "p")
        made = await key(c, pid, "write", "read")
        secret = made["secret"]
        created = await c.post(
            "/v1/models",
            json=model_body("m1"),
            headers={**bearer(secret), "X-Request-ID": "abc-123"},
        )
        assert created.status_code == 201 and created.headers["x-request-id"] == "abc-123"
        read = await c.get("/v1/models", headers=bearer(secret))  # a read: not audited
        assert read.headers["x-request-id"].startswith("req_")
        odd = await c.delete(
            "/v1/datasets/ds_nope", headers={**bearer(secret), "X-Request-ID": "bad id <script>"}
        )
        assert odd.status_code == 404, odd.text
        generated = odd.headers["x-request-id"]
        assert generated.startswith("req_")
        refused = await c.post(
            "/v1/models", json=model_body("m2"), headers=bearer("ty_" + "y" * 43)
        )
        assert refused.status_code == 401
        page = (await c.get("/v1/audit-events", headers=ROOT)).json()
        events = page["data"]
        assert [(e["method"], e["route"], e["status"]) for e in events] == [
            ("POST", "/v1/models", 401),
            ("DELETE", "/v1/datasets/{dataset_id}", 404),
            ("POST", "/v1/models", 201),
            ("POST", "/v1/projects/{project_id}/keys", 201),
            ("POST", "/v1/projects", 201),
        ]
        by_key = events[1:3]
        assert {e["key_id"] for e in by_key} == {made["id"]}
        assert {e["project_id"] for e in by_key} == {pid}
        assert [e["resource_id"] for e in events[1:]] == ["ds_nope", "m1", made["id"], pid]
        assert [e["request_id"] for e in events[1:3]] == [generated, "abc-123"]
        assert events[3]["key_id"] is None  # the env admin key
        # Filters and pages.
        mine = (await c.get("/v1/audit-events", params={"key_id": made["id"]}, headers=ROOT)).json()
        assert [e["id"] for e in mine["data"]] == [e["id"] for e in by_key]
        routed = (
            await c.get("/v1/audit-events", params={"route": "/v1/models"}, headers=ROOT)
        ).json()
        assert len(routed["data"]) == 2
        scoped = (await c.get("/v1/audit-events", params={"project_id": pid}, headers=ROOT)).json()
        assert len(scoped["data"]) == 2
        seen: list[str] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 2, **({"after": cursor} if cursor else {})}
            answer = (await c.get("/v1/audit-events", params=params, headers=ROOT)).json()
            seen += [e["id"] for e in answer["data"]]
            if not answer["has_more"]:
                break
            cursor = answer["next_cursor"]
        # the audit reads themselves are GETs: not audited
        assert seen == [e["id"] for e in events]
        future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        later = (await c.get("/v1/audit-events", params={"since": future}, headers=ROOT)).json()
        assert later["data"] == []
        before = (await c.get("/v1/audit-events", params={"until": future}, headers=ROOT)).json()
        assert len(before["data"]) == 5
        naive = await c.get(
            "/v1/audit-events", params={"since": "2026-01-01T00:00:00"}, headers=ROOT
        )
        assert naive.status_code == 422 and naive.json()["errors"][0]["path"] == "since"
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(select(AuditEventRow.__table__))).all()
    finally:
        await engine.dispose()
    dump = repr(rows)
    assert len(rows) == 5
    assert secret not in dump and "root" not in dump and "Bearer" not in dump


async def test_reads_sent_as_posts_are_not_audited(serve) -> None:
    """The Tinker SDK polls `retrieve_future` (and sends keep-alives, its handshake and
    telemetry) and samples; the gateway samples: none of it changes anything, so none of
    it is in the audit log. What does change something still is."""
    tinker = "/tinker/api/v1"
    hi = {"role": "user", "content": "hi"}
    async with serve(**FRESH, demo_model=False) as live:
        c = live.client
        pid = await project(c, "p")
        made = await key(c, pid, "write", "sample")
        mine = bearer(made["secret"])
        session = await c.post(f"{tinker}/create_session", json={}, headers=mine)
        assert session.status_code == 200, session.text
        session_id = session.json()["session_id"]
        reads = [
            (f"{tinker}/client/config", {"sdk_version": "0.38.0"}, 200),
            (f"{tinker}/client/dynamic_config", {}, 200),
            (f"{tinker}/session_heartbeat", {"session_id": session_id}, 200),
            (f"{tinker}/retrieve_future", {"request_id": "nope"}, 410),
            (f"{tinker}/get_info", {"model_id": "nope"}, 404),
            (f"{tinker}/asample", {"sampling_session_id": "nope"}, 404),
            (f"{tinker}/telemetry", {"events": []}, 200),
            ("/openai/v1/chat/completions", {"model": "nope", "messages": [hi]}, 404),
        ]
        for path, body, status in reads:
            for _ in range(3):  # as a client polls
                answer = await c.post(path, json=body, headers=mine)
                assert answer.status_code == status, (path, answer.text)
        created = await c.post("/v1/models", json=model_body("m1"), headers=mine)
        assert created.status_code == 201, created.text
        page = (await c.get("/v1/audit-events", params={"project_id": pid}, headers=ROOT)).json()
        assert [(e["method"], e["route"], e["status"]) for e in page["data"]] == [
            ("POST", "/v1/models", 201),
            ("POST", f"{tinker}/create_session", 200),
        ]


async def test_the_retention_sweep_deletes_old_audit_events(serve, database_url: str) -> None:
    engine = create_engine(database_url)
    table = AuditEventRow.__table__
    old = datetime.now(UTC) - timedelta(days=2)
    row = {"method": "POST", "route": "/v1/models", "status": 201, "request_id": "r"}
    try:
        async with engine.begin() as conn:
            await conn.execute(
                insert(table),
                [
                    {**row, "id": "aud_old1", "at": old},
                    {**row, "id": "aud_old2", "at": old},
                    {**row, "id": "aud_new", "at": datetime.now(UTC)},
                ],
            )
        assert await audit.prune(engine, 86400.0, batch=1) == 2
        async with engine.connect() as conn:
            assert list((await conn.execute(select(table.c.id))).scalars()) == ["aud_new"]
            await conn.execute(text("SELECT 1"))
        async with engine.begin() as conn:
            await conn.execute(insert(table), [{**row, "id": "aud_old3", "at": old}])
        # The workers sweep it: a worker starting prunes at once.
        async with serve(worker_enabled=True, audit_retention_seconds=86400.0):

            async def swept() -> bool:
                async with engine.connect() as conn:
                    ids = list((await conn.execute(select(table.c.id))).scalars())
                return ids == ["aud_new"]

            await until(swept, "the worker pruned the audit log")
    finally:
        await engine.dispose()


JSONL = {"Content-Type": "application/jsonl"}
DATASET = b'{"id": "e1", "messages": [{"role": "user", "content": "hi"}]}\n'


async def test_a_key_sees_only_its_projects_models_and_datasets(serve, database_url: str) -> None:
    from tests.factories import nat_collection

    async with serve(**FRESH) as live:
        c = live.client
        a, b = await project(c, "a"), await project(c, "b")
        a_write = bearer((await key(c, a, "write"))["secret"])
        b_write = bearer((await key(c, b, "write"))["secret"])
        b_read = bearer((await key(c, b, "read"))["secret"])
        assert (
            await c.post("/v1/models", json=model_body("a-model"), headers=a_write)
        ).status_code == 201
        assert (
            await c.post("/v1/models", json=model_body("root-model"), headers=ROOT)
        ).status_code == 201
        # The other project's model: 404 as if missing, left out of lists, its name taken.
        assert (await c.get("/v1/models/a-model", headers=b_read)).status_code == 404
        assert (await c.get("/v1/models", headers=b_read)).json()["data"] == []
        taken = await c.post("/v1/models", json=model_body("a-model"), headers=b_write)
        assert taken.status_code == 409 and "b" not in taken.json()["detail"].split("'")[0]
        own = (await c.get("/v1/models", headers=a_write)).json()["data"]
        assert [m["name"] for m in own] == ["a-model"]
        assert (await c.get("/v1/models/a-model", headers=a_write)).status_code == 200
        every = (await c.get("/v1/models", headers=ROOT)).json()["data"]
        assert {m["name"] for m in every} == {"a-model", "root-model"}
        # Datasets alike; deleting another project's is a 404 and deletes nothing.
        made = await c.post("/v1/datasets?name=d", content=DATASET, headers={**JSONL, **a_write})
        assert made.status_code == 201, made.text
        dataset = made.json()["id"]
        assert (await c.get(f"/v1/datasets/{dataset}", headers=b_read)).status_code == 404
        assert (await c.get("/v1/datasets", headers=b_read)).json()["data"] == []
        assert (await c.delete(f"/v1/datasets/{dataset}", headers=b_write)).status_code == 404
        assert (await c.get(f"/v1/datasets/{dataset}", headers=a_write)).status_code == 200
        again = await c.post("/v1/datasets?name=d", content=DATASET, headers={**JSONL, **b_write})
        assert again.status_code == 201 and again.json()["id"] != dataset  # B's own copy
        # A job belongs to its model's project.
        job = await c.post(
            "/v1/training-jobs",
            json={"model": "a-model", "collection": nat_collection()},
            headers=a_write,
        )
        assert job.status_code == 202, job.text
        job_id = job.json()["id"]
        # Another project's job: 404 everywhere, out of lists; its model: no such model.
        for path in (
            f"/v1/training-jobs/{job_id}",
            f"/v1/training-jobs/{job_id}/events",
            f"/v1/training-jobs/{job_id}/events/stream",
            f"/v1/training-jobs/{job_id}/trajectories",
        ):
            assert (await c.get(path, headers=b_read)).status_code == 404, path
        assert (await c.get("/v1/training-jobs", headers=b_read)).json()["data"] == []
        cancel = await c.post(f"/v1/training-jobs/{job_id}/cancel", headers=b_write)
        assert cancel.status_code == 404
        theirs = await c.post(
            "/v1/training-jobs",
            json={"model": "a-model", "collection": nat_collection()},
            headers=b_write,
        )
        assert theirs.status_code == 422
        assert theirs.json()["errors"][0]["path"] == "model"
        assert (await c.get(f"/v1/training-jobs/{job_id}", headers=a_write)).status_code == 200
        assert (
            await c.get(f"/v1/training-jobs/{job_id}/events", headers=a_write)
        ).status_code == 200
        listed = (await c.get("/v1/training-jobs", headers=ROOT)).json()["data"]
        assert [j["id"] for j in listed] == [job_id]
        assert (await c.get("/v1/rollout-jobs", headers=b_read)).json()["data"] == []
        # An evaluation of another project's model: no such model (404 at `model`); of its
        # own (a dry-run model), the model is found and refused for what it is (422).
        evaluation = {
            "model": "a-model",
            "examples": [{"id": 1, "messages": [{"role": "user", "content": "hi"}]}],
            "grader": {"type": "regex", "pattern": "x"},
        }
        theirs = await c.post("/v1/evaluation-jobs", json=evaluation, headers=b_write)
        assert theirs.status_code == 404, theirs.text
        assert [e["path"] for e in theirs.json()["errors"]] == ["model"]
        mine = await c.post("/v1/evaluation-jobs", json=evaluation, headers=a_write)
        assert mine.status_code == 422 and "cannot sample" in mine.json()["detail"], mine.text
        assert (await c.get("/v1/evaluation-jobs", headers=b_read)).json()["data"] == []
        # Its checkpoints, aliases and retention: 404 for another project's key.
        for path in ("checkpoints", "checkpoints/0", "aliases", "retention"):
            answer = await c.get(f"/v1/models/a-model/{path}", headers=b_read)
            assert answer.status_code == 404, (path, answer.text)
        alias = await c.put("/v1/models/a-model/aliases/x", json={"step": 0}, headers=b_write)
        assert alias.status_code == 404
        assert (await c.get("/v1/models/a-model/aliases", headers=a_write)).status_code == 200
        # The gateway: another project's model does not exist for a `sample` key.
        chat = {"model": "a-model", "messages": [{"role": "user", "content": "hi"}]}
        a_sample = bearer((await key(c, a, "sample"))["secret"])
        b_sample = bearer((await key(c, b, "sample"))["secret"])
        theirs = await c.post("/openai/v1/chat/completions", json=chat, headers=b_sample)
        assert theirs.status_code == 404
        assert theirs.json()["error"]["code"] == "model_not_found"
        assert "does not exist" in theirs.json()["error"]["message"]
        mine = await c.post("/openai/v1/chat/completions", json=chat, headers=a_sample)
        assert "does not exist" not in mine.json()["error"]["message"]  # found: not served
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            jobs = (await conn.execute(text("SELECT id, project_id FROM jobs"))).all()
            models = dict((await conn.execute(text("SELECT name, project_id FROM models"))).all())
    finally:
        await engine.dispose()
    assert jobs == [(job.json()["id"], a)]
    assert models == {"a-model": a, "root-model": DEFAULT_PROJECT_ID}


async def test_keys_that_cannot_be_read_refuse_with_503_never_let_in(
    serve, database_url: str
) -> None:
    async with serve(key_cache_seconds=0) as live:
        engine = create_engine(database_url)
        try:
            async with engine.begin() as conn:
                await conn.execute(text("ALTER TABLE api_keys RENAME TO api_keys_away"))
            refused = await live.client.get("/v1/models")
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.headers["content-type"] == "application/problem+json"
            async with engine.begin() as conn:
                await conn.execute(text("ALTER TABLE api_keys_away RENAME TO api_keys"))
            assert (await live.client.get("/v1/models")).status_code == 200
        finally:
            await engine.dispose()


async def test_idempotency_keys_are_each_projects_own(serve) -> None:
    """The same Idempotency-Key from two projects: neither replays, nor learns of, the
    other's job."""
    from tests.factories import nat_collection

    async with serve(**FRESH) as live:
        c = live.client
        a, b = await project(c, "a"), await project(c, "b")
        a_write = bearer((await key(c, a, "write"))["secret"])
        b_write = bearer((await key(c, b, "write"))["secret"])
        for name, headers in (("a-model", a_write), ("b-model", b_write)):
            made = await c.post("/v1/models", json=model_body(name), headers=headers)
            assert made.status_code == 201, made.text
        body = {"model": "a-model", "collection": nat_collection()}
        same = {"Idempotency-Key": "step-1"}
        first = await c.post("/v1/training-jobs", json=body, headers={**a_write, **same})
        assert first.status_code == 202, first.text
        # B sends A's very body with A's key: no replay of A's job, A's model is unknown.
        copied = await c.post("/v1/training-jobs", json=body, headers={**b_write, **same})
        assert copied.status_code == 422, copied.text
        assert first.json()["id"] not in copied.text
        # B's own body with the same key: a job of its own, not "key used with another body".
        own = {"model": "b-model", "collection": nat_collection()}
        theirs = await c.post("/v1/training-jobs", json=own, headers={**b_write, **same})
        assert theirs.status_code == 202, theirs.text
        assert theirs.json()["id"] != first.json()["id"]
        # Each project's retry still replays its own.
        again = await c.post("/v1/training-jobs", json=body, headers={**a_write, **same})
        assert again.json()["id"] == first.json()["id"]
        assert again.headers["idempotent-replayed"] == "true"


async def test_the_worker_list_shows_a_key_only_its_projects_jobs(serve) -> None:
    """Workers are shared; the ids of the jobs each runs are not: another project's running
    job is left out (the isolation matrix found them listed)."""
    from tests.factories import nat_collection

    async with serve(**FRESH, worker_enabled=True) as live:
        c = live.client
        a, b = await project(c, "a"), await project(c, "b")
        a_write = bearer((await key(c, a, "write"))["secret"])
        b_read = bearer((await key(c, b, "read"))["secret"])
        body = model_body("slow", seconds_per_step=3600)
        assert (await c.post("/v1/models", json=body, headers=a_write)).status_code == 201
        job = await c.post(
            "/v1/training-jobs",
            json={"model": "slow", "collection": nat_collection()},
            headers=a_write,
        )
        job_id = job.json()["id"]

        async def running() -> bool:
            shown = await c.get(f"/v1/training-jobs/{job_id}", headers=a_write)
            return bool(shown.json()["status"] == "running")

        try:
            await until(running, "the job running")
            for who, jobs in ((a_write, [job_id]), (ROOT, [job_id]), (b_read, [])):
                (worker,) = (await c.get("/v1/workers", headers=who)).json()
                assert worker["jobs"] == jobs
        finally:
            await c.post(f"/v1/training-jobs/{job_id}/cancel", headers=ROOT)
