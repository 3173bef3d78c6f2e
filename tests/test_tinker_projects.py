"""Project keys on the Tinker surface (issue 30), over real HTTP on both dialects: the SDK
takes a project key in its `tml-` form (`tinker_api_key`); a training run made with it is a
model of the key's project, which another project's key cannot reach (no session, run,
future, sampler or checkpoint of it: 404, or 410 for a future, as for none); training needs
`write`, sampling `sample` (or `write`), the RestClient's views `read` (or `write`). First
as the SDK's requests, then through the real SDK (tinker 0.38.0, in its own environment)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer
from tests.test_projects import ROOT, bearer, key, project
from tests.test_readme import README, README_ADDRESS, SHELL_LANGUAGES, fenced_blocks
from tests.test_tinker_sdk import DATA, PYTHON, SECTION, readme_program

pytestmark = [pytest.mark.slow, pytest.mark.torch]

V1 = "/tinker/api/v1"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from app.backends.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tinker-project-models") / "tiny")


@pytest.fixture
async def live(serve: Callable[..., LiveServer], tiny_model: Path) -> Any:
    settings = {"api_keys": "root", "key_cache_seconds": 0, "demo_model": False}
    async with serve(model_roots=[tiny_model.parent], **settings) as server:
        yield server


class Team:
    """A project with a `write`, a `read` and a `sample` key, and a cpu model of its own."""

    def __init__(self, project_id: str, keys: dict[str, dict[str, Any]]) -> None:
        self.project_id = project_id
        self.keys = keys

    def tinker(self, scope: str) -> dict[str, str]:
        """The header the SDK sends with this scope's key."""
        return {"X-API-Key": self.keys[scope]["tinker_api_key"]}


async def team(client: httpx.AsyncClient, name: str, base: Path | None) -> Team:
    project_id = await project(client, name)
    keys = {scope: await key(client, project_id, scope) for scope in ("write", "read", "sample")}
    for made in keys.values():
        assert made["tinker_api_key"] == "tml-" + made["secret"]
    if base is not None:
        body = {"name": f"{name}-base", "base_model": str(base), "backend": "cpu"}
        registered = await client.post(
            "/v1/models", json=body, headers=bearer(keys["write"]["secret"])
        )
        assert registered.status_code == 201, registered.text
    return Team(project_id, keys)


async def answered(
    client: httpx.AsyncClient, headers: dict[str, str], future: httpx.Response
) -> Any:
    assert future.status_code == 200, future.text
    body = {"request_id": future.json()["request_id"]}
    for _ in range(30):  # a long poll of up to 20 s each: 408 asks again
        done = await client.post(f"{V1}/retrieve_future", json=body, headers=headers)
        if done.status_code != 408:
            assert done.status_code == 200, done.text
            return done
    raise AssertionError("the future never finished")


async def test_a_project_keys_tinker_run_is_its_projects_alone(
    live: LiveServer, tiny_model: Path
) -> None:
    c = live.client
    a = await team(c, "team-a", tiny_model)
    b = await team(c, "team-b", None)
    write, other = a.tinker("write"), b.tinker("write")

    async def post(headers: dict[str, str], path: str, body: dict[str, Any]) -> httpx.Response:
        return await c.post(f"{V1}/{path}", json=body, headers=headers)

    async def capabilities(headers: dict[str, str]) -> list[str]:
        answer = await c.get(f"{V1}/get_server_capabilities", headers=headers)
        return sorted(m["model_name"] for m in answer.json()["supported_models"])

    # Base models: the key's project's cpu models (every one for an admin key).
    assert await capabilities(write) == ["team-a-base"]
    assert await capabilities(other) == []
    assert await capabilities(ROOT) == ["team-a-base"]
    session = (await post(write, "create_session", {})).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": "team-a-base"}
    body["lora_config"] = {"rank": 2}
    for scope in ("read", "sample"):  # training needs `write`
        refused = await post(a.tinker(scope), "create_model", body)
        assert refused.status_code == 403 and refused.json()["missing_scope"] == "write"
    created = await post(write, "create_model", body)
    model_id = (await answered(c, write, created)).json()["model_id"]
    run = f"tinker-{session}-0"
    # The run is a model of the key's project: its keys see it, the other project's do not.
    model = await c.get(f"/v1/models/{run}", headers=bearer(a.keys["read"]["secret"]))
    assert model.status_code == 200 and model.json()["project"] == "tinker", model.text
    hidden = await c.get(f"/v1/models/{run}", headers=bearer(b.keys["read"]["secret"]))
    assert hidden.status_code == 404, hidden.text
    saved = await post(
        write, "save_weights_for_sampler", {"model_id": model_id, "seq_id": 1, "path": "w"}
    )
    path = (await answered(c, write, saved)).json()["path"]
    assert path == f"tinker://{run}/sampler_weights/w"

    # Another project's key: no session, no base model, no run, no future, no checkpoint.
    their_session = (await post(other, "create_session", {})).json()["session_id"]
    refusals = [
        ("create_model", {**body, "model_seq_id": 1}, 404, "session_id"),
        ("create_model", {**body, "session_id": their_session}, 400, "base_model"),
        ("session_heartbeat", {"session_id": session}, 404, "session_id"),
        ("get_info", {"model_id": model_id}, 404, "model_id"),
        ("optim_step", {"model_id": model_id, "seq_id": 2}, 404, "model_id"),
        ("save_weights", {"model_id": model_id, "seq_id": 2, "path": "x"}, 404, "model_id"),
        ("load_weights", {"model_id": model_id, "seq_id": 2, "path": path}, 404, "path"),
        ("retrieve_future", {"request_id": created.json()["request_id"]}, 410, "request_id"),
        ("retrieve_future", {"request_id": saved.json()["request_id"]}, 410, "request_id"),
        (
            "create_sampling_session",
            {"session_id": their_session, "model_path": path},
            404,
            "model_path",
        ),
        (
            "create_sampling_session",
            {"session_id": their_session, "base_model": "team-a-base"},
            400,
            "base_model",
        ),
    ]
    for route, sent, status, field in refusals:
        answer = await post(other, route, sent)
        assert answer.status_code == status, (route, answer.text)
        assert answer.json()["detail"].startswith(f"{field}:"), (route, answer.json())
    for route in (f"training_runs/{run}", f"training_runs/{model_id}/checkpoints"):
        answer = await c.get(f"{V1}/{route}", headers=other)
        assert answer.status_code == 404 and answer.json()["detail"].startswith("training_run_id:")
    assert (await c.get(f"{V1}/training_runs", headers=other)).json()["training_runs"] == []
    assert (await c.get(f"{V1}/checkpoints", headers=other)).json()["checkpoints"] == []
    info = await post(other, "weights_info", {"tinker_path": path})
    assert info.status_code == 404 and info.json()["detail"].startswith("tinker_path:")
    checkpoint = f"{V1}/training_runs/{run}/checkpoints/sampler_weights/w"
    gone = await c.delete(checkpoint, headers=other)
    assert gone.status_code == 404 and gone.json()["detail"].startswith("checkpoint_id:")
    # Its own `read` key lists and describes its checkpoints, and may not delete them.
    mine = (await c.get(f"{V1}/checkpoints", headers=a.tinker("read"))).json()["checkpoints"]
    assert [x["tinker_path"] for x in mine] == [path]
    info = await post(a.tinker("read"), "weights_info", {"tinker_path": path})
    assert info.json()["lora_rank"] == 2 and info.json()["is_lora"] is True
    refused = await c.delete(checkpoint, headers=a.tinker("read"))
    assert refused.status_code == 403 and refused.json()["missing_scope"] == "write"

    # Its own project's keys: `read` lists and reads the run, `sample` samples its weights.
    listed = (await c.get(f"{V1}/training_runs", headers=a.tinker("read"))).json()
    assert [r["training_run_id"] for r in listed["training_runs"]] == [run]
    refused = await post(a.tinker("read"), "create_sampling_session", {"model_path": path})
    assert refused.status_code == 403 and refused.json()["missing_scope"] == "sample"
    sampler = await post(a.tinker("sample"), "create_sampling_session", {"model_path": path})
    assert sampler.status_code == 200, sampler.text
    sampler_id = sampler.json()["sampling_session_id"]
    prompt = {"chunks": [{"tokens": [3, 5, 7]}]}
    request = {"sampling_session_id": sampler_id, "seq_id": 0, "prompt": prompt}
    request["sampling_params"] = {"max_tokens": 2, "temperature": 0.0}
    sampled = await post(a.tinker("sample"), "asample", request)
    await answered(c, a.tinker("sample"), sampled)
    assert (await answered(c, write, sampled)).status_code == 200  # the project's other key
    # The sampler and its sample are not the other project's.
    for route, sent, status in [
        ("asample", {**request, "seq_id": 1}, 404),
        ("retrieve_future", {"request_id": sampled.json()["request_id"]}, 410),
    ]:
        answer = await post(other, route, sent)
        assert answer.status_code == status, (route, answer.text)
    assert (await c.get(f"{V1}/samplers/{sampler_id}", headers=other)).status_code == 404
    # At the gateway the path is the project's model (here no worker serves it yet: 503,
    # try again); for another project's key it does not exist.
    chat = {"model": path, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answers = [
        await c.post("/openai/v1/chat/completions", json=chat, headers=bearer(k["secret"]))
        for k in (a.keys["sample"], b.keys["sample"])
    ]
    codes = [(r.status_code, r.json()["error"]["code"]) for r in answers]
    assert codes == [(503, "model_unavailable"), (404, "model_not_found")], codes
    # The admin key reaches every project's run; the key's own secret works as itself too.
    assert (await post(ROOT, "get_info", {"model_id": model_id})).status_code == 200
    plain = {"X-API-Key": a.keys["write"]["secret"]}
    assert (await post(plain, "get_info", {"model_id": model_id})).status_code == 200
    # Nothing the other project was refused was stored: A's base model and run only.
    names = (await c.get("/v1/models", headers=ROOT)).json()["data"]
    assert sorted(m["name"] for m in names) == sorted(["team-a-base", run])


async def test_the_operators_base_models_are_every_projects_and_the_runs_their_own(
    serve: Callable[..., LiveServer], tiny_model: Path
) -> None:
    """`demo` (and a model directory under the model roots) is a base for every project's
    keys; what they make of it (runs, samplers) is their own project's."""
    settings = {"api_keys": "root", "key_cache_seconds": 0, "demo_model": True}
    async with serve(model_roots=[tiny_model.parent], **settings) as live:
        c = live.client
        a = await team(c, "team-a", None)
        b = await team(c, "team-b", tiny_model)

        async def post(headers: dict[str, str], path: str, body: dict[str, Any]) -> Any:
            return await c.post(f"{V1}/{path}", json=body, headers=headers)

        async def capabilities(headers: dict[str, str]) -> list[str]:
            answer = await c.get(f"{V1}/get_server_capabilities", headers=headers)
            return sorted(m["model_name"] for m in answer.json()["supported_models"])

        assert await capabilities(a.tinker("read")) == ["demo"]
        assert await capabilities(b.tinker("read")) == ["demo", "team-b-base"]
        runs = {}
        for name, t in (("a", a), ("b", b)):
            session = (await post(t.tinker("write"), "create_session", {})).json()["session_id"]
            body = {"session_id": session, "model_seq_id": 0, "base_model": "demo"}
            body["lora_config"] = {"rank": 2}
            created = await post(t.tinker("write"), "create_model", body)
            model_id = (await answered(c, t.tinker("write"), created)).json()["model_id"]
            runs[name] = (f"tinker-{session}-0", model_id)
        for name, t, o in (("a", a, b), ("b", b, a)):
            run, model_id = runs[name]
            mine = await c.get(f"/v1/models/{run}", headers=bearer(t.keys["read"]["secret"]))
            assert mine.status_code == 200, mine.text
            theirs = await c.get(f"/v1/models/{run}", headers=bearer(o.keys["read"]["secret"]))
            assert theirs.status_code == 404, theirs.text
            refused = await post(o.tinker("write"), "get_info", {"model_id": model_id})
            assert refused.status_code == 404, refused.text
        # `demo` itself stays the default project's model: listed by no project key.
        demo = await c.get("/v1/models/demo", headers=bearer(a.keys["read"]["secret"]))
        assert demo.status_code == 404, demo.text
        # Samplers of the operator's bases are the project's of the key that made them.
        for base in ("demo", str(tiny_model)):
            made = await post(a.tinker("sample"), "create_sampling_session", {"base_model": base})
            assert made.status_code == 200, made.text
            sampler_id = made.json()["sampling_session_id"]
            for t, status in ((a, 200), (b, 404)):
                seen = await c.get(f"{V1}/samplers/{sampler_id}", headers=t.tinker("sample"))
                assert seen.status_code == status, (base, seen.text)
            prompt = {"chunks": [{"tokens": [3, 5, 7]}]}
            request = {"sampling_session_id": sampler_id, "seq_id": 0, "prompt": prompt}
            request["sampling_params"] = {"max_tokens": 2, "temperature": 0.0}
            refused = await post(b.tinker("sample"), "asample", request)
            assert refused.status_code == 404, refused.text
            await answered(
                c, a.tinker("sample"), await post(a.tinker("sample"), "asample", request)
            )
        # Another project's registered model is still no base for the key (400).
        body = {"session_id": "s" + "0" * 12, "model_seq_id": 0, "base_model": "team-b-base"}
        refused = await post(a.tinker("write"), "create_model", body)
        assert refused.status_code == 400 and refused.json()["detail"].startswith("base_model:")


async def test_sessions_and_samplers_stay_their_projects_after_a_restart(
    live: LiveServer, tiny_model: Path
) -> None:
    """Processes are `TinkerService` objects over one database (as in test_tinker_journal):
    the next one knows a session and a sampler of a base directory only from their rows,
    and tells another project's key, even the first to ask, that there are none."""
    from app.tenants.keys import Principal
    from app.tinker.service import TinkerError, TinkerService

    state = live.app.state

    def process() -> TinkerService:
        return TinkerService(state.settings, state.sessions, state.backends)

    def key_of(project_id: str) -> Principal:
        return Principal(key_id=None, project_id=project_id, scopes=frozenset({"write"}))

    a = key_of(await project(live.client, "team-a"))
    b = key_of(await project(live.client, "team-b"))
    first = process()
    session = await first.create_session(a)
    body = {"base_model": str(tiny_model)}
    sampler_id = await first.create_sampling_session(body, a)
    del first

    after = process()
    for refused in (after.heartbeat(session, b), after.sampler(sampler_id, b)):
        with pytest.raises(TinkerError) as raised:
            await refused
        assert raised.value.status == 404, raised.value
    await after.heartbeat(session, a)
    assert (await after.sampler(sampler_id, a)).project_id == a.project_id


def sdk(url: str, tinker_key: str, *args: str) -> dict[str, Any]:
    """`project.py` with `args` in the SDK's own environment, told where Trainyard is and
    which key to send only as the README says."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "TINKER_"))}
    env.pop("PYTHONPATH", None)
    env |= {"TINKER_BASE_URL": f"{url}/tinker", "TINKER_API_KEY": tinker_key}
    env["HF_HUB_OFFLINE"] = "1"
    ran = subprocess.run(
        [str(PYTHON), str(DATA / "project.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    outcome: dict[str, Any] = json.loads(ran.stdout.strip().splitlines()[-1])
    return outcome


async def test_the_sdk_trains_and_samples_with_a_project_key(
    live: LiveServer, tiny_model: Path
) -> None:
    if not PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{PYTHON} is missing: CI builds it (make .venv-tinker/.installed)")
        pytest.skip("no Tinker SDK environment: make .venv-tinker/.installed")
    a = await team(live.client, "team-a", tiny_model)
    b = await team(live.client, "team-b", tiny_model)

    def run_as(team_: Team, scope: str, *args: str) -> Any:
        return asyncio.to_thread(sdk, live.url, team_.keys[scope]["tinker_api_key"], *args)

    mine = await run_as(a, "write", "train", "team-a-base")
    trained = mine["trained"]
    assert isinstance(trained, dict), mine
    session, _, seq = trained["model_id"].split(":")
    run = f"tinker-{session}-{seq}"
    assert trained["path"] == f"tinker://{run}/sampler_weights/mine"
    assert len(trained["said"]) == 4 and mine["runs"] == [run]
    for team_, status in ((a, 200), (b, 404)):
        model = await live.client.get(
            f"/v1/models/{run}", headers=bearer(team_.keys["read"]["secret"])
        )
        assert model.status_code == status, model.text

    # Another project's key: the run, its checkpoints and its weights do not exist; the
    # other project's base model neither (as a base model the key does not see: 400).
    theirs = await run_as(b, "write", "other", "team-a-base", trained["path"], run)
    assert theirs["runs"] == []
    for name in ("run", "checkpoints", "sample path"):
        assert theirs[name].startswith("NotFoundError"), (name, theirs)
    for name in ("sample base", "train base"):
        assert theirs[name].startswith("BadRequestError"), (name, theirs)
        assert "base_model" in theirs[name], theirs
    # The project's `read` key lists and reads, and neither samples nor trains (403).
    read = await run_as(a, "read", "other", "team-a-base", trained["path"], run)
    assert read["runs"] == [run] and read["run"] == run and read["checkpoints"] == 1
    for name in ("sample path", "sample base", "train base"):
        assert read[name].startswith("PermissionDeniedError"), (name, read)
    # Its `sample` key samples the run's weights (the same greedy answer), and cannot train.
    sample = await run_as(a, "sample", "other", "team-a-base", trained["path"], run)
    assert sample["sample path"] == trained["said"], sample
    assert isinstance(sample["sample base"], list), sample
    assert sample["train base"].startswith("PermissionDeniedError"), sample
    assert "`write`" in sample["train base"], sample


def readme_project_block() -> str:
    """The Tinker section's shell block that makes a project key and trains with it."""
    text = README.read_text()
    start = text.index(f"\n{SECTION}\n")
    section = text[start : text.index("\n## ", start + 1)]
    blocks = [
        b
        for b in fenced_blocks(section)
        if b.language in SHELL_LANGUAGES and any("trainyard-client" in line for line in b.lines)
    ]
    assert len(blocks) == 1, "the Tinker section shows one project key, made with the CLI"
    return "\n".join(blocks[0].lines)


async def test_the_readme_trains_with_a_project_key_as_written(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    """The README's block, run as written (the server's address aside) against a server
    with the README's admin key and `demo` model: it makes a project and a `write` key, and
    runs the README's program with that key's Tinker form, on `demo` (the operator's). The
    program's run is the project's, and no other project's key sees it."""
    if not PYTHON.exists():
        pytest.skip("no Tinker SDK environment: make .venv-tinker/.installed")
    settings = {"api_keys": "tml-local-key", "key_cache_seconds": 0, "demo_model": True}
    async with serve(**settings) as live:
        address = live.url.removeprefix("http://")
        (tmp_path / "program.py").write_text(readme_program())
        prelude = (
            "set -euo pipefail\n"
            # `python` is the SDK's environment, which imports nothing of this checkout.
            f'python() {{ env -u PYTHONPATH "{PYTHON}" "$@"; }}\n'
        )
        script = prelude + readme_project_block().replace(README_ADDRESS, address)
        script += '\necho "key=$TINKER_API_KEY project=$PROJECT"\n'
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "TINKER_"))}
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # trainyard-client
        env |= {"TINKER_BASE_URL": f"{live.url}/tinker", "HF_HUB_OFFLINE": "1"}
        ran = await asyncio.to_thread(
            subprocess.run,
            ["bash", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
        lines = ran.stdout.strip().splitlines()
        assert lines[0] == "['demo']", ran.stdout  # the operator's base model, every key's
        share = re.fullmatch(r"share of token (\d+): ([\d.]+) -> ([\d.]+)", lines[-2])
        assert share and float(share.group(2)) < 0.5 <= 0.8 <= float(share.group(3)), ran.stdout
        found = re.fullmatch(r"key=(tml-ty_\S+) project=(\S+)", lines[-1])
        assert found, ran.stdout
        secret = found.group(1).removeprefix("tml-")
        runs = await live.client.get("/v1/models", params={"limit": 100}, headers=bearer(secret))
        names = sorted(m["name"] for m in runs.json()["data"])
        assert len(names) == 1 and names[0].startswith("tinker-s"), names  # its run alone
        admin = bearer("tml-local-key")
        made = await live.client.post("/v1/projects", json={"name": "team-b"}, headers=admin)
        theirs = await live.client.post(
            f"/v1/projects/{made.json()['id']}/keys",
            json={"name": "reader", "scopes": ["read"]},
            headers=admin,
        )
        their_key = bearer(theirs.json()["secret"])
        hidden = await live.client.get(f"/v1/models/{names[0]}", headers=their_key)
        assert hidden.status_code == 404, hidden.text
