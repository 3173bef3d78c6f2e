"""Hostile request bodies, sent as an attacker sends them: raw bytes over real HTTP, to a
real database (SQLite; Postgres too when TRAINYARD_TEST_DATABASE_URL is set).

Every body is parsed by one strict reader (`app.api.body`, `app.ingest.jsontext`): text that is
not UTF-8, a string or key that is not valid Unicode, NaN, nesting past the limit, counts
past the limits are refused with the path of what is wrong, and nothing is stored. What
is accepted is what the worker can read back: each accepted body's stored spec decodes.
Each case runs twice: a small body (read in the request's task) and the same body padded
past `INLINE_BYTES` with whitespace (read in a thread).
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from app.api.body import INLINE_BYTES
from app.db import create_engine
from app.jobs.payloads import Payload
from app.models import JobRow, ModelRow
from app.rollouts import spec as rollout_spec
from app.schemas.rollouts import Example
from app.training import spec as training_spec
from tests import factories as f

SIZES = ["inline", "threaded"]
PAD = INLINE_BYTES + 1024
JSON = {"content-type": "application/json"}


def text_of(body: Any) -> str:
    """JSON text as Python writes it: lone surrogates become `\\udXXX` escapes."""
    return json.dumps(body)


async def post(client: Any, url: str, body: Any, size: str = "inline", **headers: str) -> Any:
    raw = body if isinstance(body, bytes) else text_of(body).encode()
    if size == "threaded":
        raw += b" " * PAD
    method = "PUT" if "/aliases/" in url or url.endswith("/retention") else "POST"
    return await client.request(method, url, content=raw, headers={**JSON, **headers})


def problem(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    return body


def paths_of(body: dict[str, Any]) -> list[str]:
    return [e["path"] for e in body["errors"]]


async def stored(database_url: str) -> tuple[int, int]:
    """(jobs, models) in the database."""
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            jobs = len((await conn.execute(select(JobRow.id))).all())
            models = len((await conn.execute(select(ModelRow.name))).all())
    finally:
        await engine.dispose()
    return jobs, models


async def stored_payload(database_url: str, job_id: str) -> Payload:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    select(JobRow.payload_format, JobRow.payload, JobRow.payload_bytes).where(
                        JobRow.id == job_id
                    )
                )
            ).one()
    finally:
        await engine.dispose()
    return Payload(row[0], row[1], row[2])


async def register_served_model(server: Any) -> Any:
    """`toy` on the cpu backend (it serves: rollouts can sample it), its base model under
    the data directory, a model root. The worker is off: nothing loads it."""
    base = Path(server.app.state.settings.data_dir).resolve() / "toy-base"
    base.mkdir(parents=True, exist_ok=True)
    return await server.client.post(
        "/v1/models", json={"name": "toy", "base_model": str(base), "backend": "cpu"}
    )


@pytest.fixture
async def live(serve) -> AsyncIterator[Any]:
    async with serve() as server:
        await f.create_model(server.client)
        response = await register_served_model(server)
        assert response.status_code == 201, response.text
        yield server


def training(**extra: Any) -> dict[str, Any]:
    return {"model": "agent", "groups": f.art_groups([[1.0, 0.0]]), **extra}


def nat_training(**extra: Any) -> dict[str, Any]:
    return {"model": "agent", "collection": f.nat_collection([[1.0, 0.0]]), **extra}


def rollout(**extra: Any) -> dict[str, Any]:
    return {
        "model": "toy",
        "examples": [{"id": "q1", "messages": [{"role": "user", "content": "hi"}]}],
        "grader": {"type": "regex", "pattern": "yes"},
        **extra,
    }


def with_(document: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    document = copy.deepcopy(document)
    node = document
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return document


def renamed(document: dict[str, Any], path: tuple[Any, ...], key: str) -> dict[str, Any]:
    """`document` with the key at `path` renamed to `key`, keeping its value."""
    document = copy.deepcopy(document)
    node = document
    for part in path[:-1]:
        node = node[part]
    node[key] = node.pop(path[-1])
    return document


MAC = ("groups", 0, "trajectories", 0, "messages_and_choices")
EPISODE = ("collection", "trajectories", 0, 0, "episode")

# (url, body, path of the refused value)
SURROGATES = [
    ("/v1/models", f.model_body("m1", fail_with="\ud800"), "config.fail_with"),
    ("/v1/models", f.model_body("m1", **{"\udfff": 1}), "config.\\udfff"),
    ("/v1/models", {**f.model_body("m1"), "base_model": "x\udc00y"}, "base_model"),
    ("/v1/training-jobs", training(metadata={"k": "\udfff"}), "metadata.k"),
    ("/v1/training-jobs", training(metadata={"k\ud800": 1}), "metadata.k\\ud800"),
    (
        "/v1/training-jobs",
        training(hyperparameters={"learning_rate": 1, "\ud801": 2}),
        "hyperparameters.\\ud801",
    ),
    (
        "/v1/training-jobs",
        with_(training(), (*MAC, 0, "content"), "hi \ud83d"),
        "groups[0].trajectories[0].messages_and_choices[0].content",
    ),
    (
        "/v1/training-jobs",
        with_(training(), (*MAC, 1, "message", "content"), "\ude00\ud83d"),
        "groups[0].trajectories[0].messages_and_choices[1].message.content",
    ),
    (
        "/v1/training-jobs",
        with_(training(), (*MAC, 1, "logprobs", "content", 0, "token"), "token_id:\udbff"),
        "groups[0].trajectories[0].messages_and_choices[1].logprobs.content[0].token",
    ),
    (
        "/v1/training-jobs",
        with_(nat_training(), (*EPISODE, 1, "content"), "2+2\ud800?"),
        "collection.trajectories[0][0].episode[1].content",
    ),
    (
        "/v1/training-jobs",
        with_(nat_training(), ("collection", "run_id"), "\udfff"),
        "collection.run_id",
    ),
    ("/v1/training-jobs", {**training(), "model": "\ud800"}, "model"),
    (
        "/v1/rollout-jobs",
        with_(rollout(), ("examples", 0, "messages", 0, "content"), "\ud800"),
        "examples[0].messages[0].content",
    ),
    ("/v1/rollout-jobs", with_(rollout(), ("examples", 0, "id"), "q\udfff"), "examples[0].id"),
    ("/v1/rollout-jobs", rollout(metadata={"\udcff": "x"}), "metadata.\\udcff"),
    ("/v1/rollout-jobs", rollout(grader={"type": "regex", "pattern": "\ud800"}), "grader.pattern"),
    ("/v1/models/agent/retention", {"keep_last": 2, "keep_best_by": "loss\udc00"}, "keep_best_by"),
    ("/v1/models/agent/aliases/good", {"step": 0, "\ud800": 1}, "\\ud800"),
    # Not even where the schema would refuse the field anyway.
    ("/v1/training-jobs", training(**{"\ud800unknown": 1}), "\\ud800unknown"),
]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(("url", "body", "path"), SURROGATES)
async def test_a_lone_surrogate_anywhere_is_422_at_its_path_and_nothing_is_stored(
    live, database_url, url, body, path, size
) -> None:
    before = await stored(database_url)
    answer = problem(await post(live.client, url, body, size), 422)
    assert paths_of(answer) == [path]
    assert answer["errors"][0]["type"] == "string_unicode"
    assert "lone surrogate" in answer["errors"][0]["message"]
    assert await stored(database_url) == before
    for page in ("/v1/models", "/v1/training-jobs", "/v1/rollout-jobs"):
        assert (await live.client.get(page)).status_code == 200


async def test_every_surrogate_is_listed_and_a_valid_pair_is_text(live, database_url) -> None:
    body = training(metadata={"a": "\ud800", "b": ["ok", "\udfff"], "c\udc00": "x"})
    answer = problem(await post(live.client, "/v1/training-jobs", body), 422)
    assert paths_of(answer) == ["metadata.a", "metadata.b[1]", "metadata.c\\udc00"]
    # An escaped pair is one character: accepted, stored, returned as that character.
    response = await post(live.client, "/v1/training-jobs", training(metadata={"e": "\U0001f600"}))
    assert response.status_code == 202, response.text
    assert response.json()["metadata"] == {"e": "\U0001f600"}
    assert '"\\ud83d\\ude00"' in text_of({"e": "\U0001f600"})  # it was sent escaped


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(
    ("text", "path", "kind"),
    [
        ('{"model": "agent", "metadata": {"x": NaN}, "groups": []}', "metadata.x", "NaN"),
        (
            '{"model": "agent", "metadata": {"x": [-Infinity]}, "groups": []}',
            "metadata.x[0]",
            "-Infinity",
        ),
        ('{"model": "agent", "metadata": {"x": 1e400}, "groups": []}', "metadata.x", "large"),
        ('{"model": "agent", "metadata": {"x": -1.5E+309}, "groups": []}', "metadata.x", "large"),
        # A two-digit exponent: the digits make it infinite.
        (
            '{"model": "agent", "metadata": {"x": 1' + "0" * 300 + 'e10}, "groups": []}',
            "metadata.x",
            "large",
        ),
        ('{"model": "agent", "policy_step": Infinity, "groups": []}', "policy_step", "Infinity"),
    ],
)
async def test_numbers_json_does_not_have_are_422_at_their_path(
    live, database_url, text, path, kind, size
) -> None:
    before = await stored(database_url)
    answer = problem(await post(live.client, "/v1/training-jobs", text.encode(), size), 422)
    assert paths_of(answer) == [path]
    assert answer["errors"][0]["type"] == "finite_number"
    assert await stored(database_url) == before


# ------------------------------------------------------------------------- the text itself

ENCODINGS = [
    ("utf-8 BOM", b"\xef\xbb\xbf" + text_of(training()).encode(), "byte order mark"),
    ("utf-16", text_of(training()).encode("utf-16"), "UTF-16 or UTF-32"),
    ("utf-16-le", text_of(training()).encode("utf-16-le"), "UTF-16 or UTF-32"),
    ("utf-16-be", text_of(training()).encode("utf-16-be"), "UTF-16 or UTF-32"),
    ("utf-32", text_of(training()).encode("utf-32"), "UTF-16 or UTF-32"),
    ("utf-32-be", text_of(training()).encode("utf-32-be"), "UTF-16 or UTF-32"),
    (
        "latin-1",
        json.dumps(training(metadata={"k": "é"}), ensure_ascii=False).encode("latin-1"),
        "not UTF-8 text",
    ),
    (
        "CESU-8 surrogate",
        text_of(training()).encode()[:-1] + b', "x": "\xed\xa0\x80"}',
        "not UTF-8 text",
    ),
]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(("name", "raw", "says"), ENCODINGS, ids=[e[0] for e in ENCODINGS])
async def test_json_that_is_not_utf8_is_a_clear_422(live, database_url, name, raw, says, size):
    before = await stored(database_url)
    answer = problem(await post(live.client, "/v1/training-jobs", raw, size), 422)
    [error] = answer["errors"]
    assert error["path"] == "" and error["type"] == "json_invalid" and says in error["message"]
    assert await stored(database_url) == before


async def test_a_charset_other_than_utf8_is_a_clear_422(live, database_url) -> None:
    raw = text_of(training()).encode("utf-16")
    headers = {"content-type": "application/json; charset=utf-16"}
    response = await live.client.post("/v1/training-jobs", content=raw, headers=headers)
    [error] = problem(response, 422)["errors"]
    assert "charset=utf-16" in error["message"] and error["type"] == "json_invalid"
    headers = {"content-type": "application/json; charset=UTF-8"}
    raw = text_of(training()).encode()
    assert (
        await live.client.post("/v1/training-jobs", content=raw, headers=headers)
    ).status_code == 202


def nested(depth: int, leaf: Any = 1) -> Any:
    """A value `depth` arrays deep (`[[1]]` is 2 deep)."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# A message of a body's trajectory is 7 deep (the body, groups, a group, its trajectories,
# a trajectory, its messages_and_choices, the message): a value in it adds its own depth.
AT_MESSAGE = 7


def deep_text(body: Any, depth: int, leaf: str = "1") -> bytes:
    """`body` with its "DEEP" string replaced by `depth` nested arrays (json.dumps cannot
    write them: it recurses)."""
    return text_of(body).replace('"DEEP"', "[" * depth + leaf + "]" * depth).encode()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("depth", [65, 100, 199, 201, 500, 999, 1001, 5000, 100_000])
async def test_nesting_past_the_limit_is_422_wherever_it_is(live, database_url, depth, size):
    before = await stored(database_url)
    deep = deep_text(with_(training(), (*MAC, 0, "extra"), "DEEP"), depth - AT_MESSAGE)
    answer = problem(await post(live.client, "/v1/training-jobs", deep, size), 422)
    [error] = answer["errors"]
    assert error["type"] == "json_too_deep" and "deeper than 64 levels" in error["message"]
    assert error["path"].startswith("groups[0].trajectories[0].messages_and_choices[0].extra[0]")
    # A body that is all brackets.
    answer = problem(
        await post(live.client, "/v1/rollout-jobs", deep_text("DEEP", depth), size), 422
    )
    assert answer["errors"][0]["type"] == "json_too_deep"
    assert await stored(database_url) == before


# -------------------------------------------------------- what is accepted, the worker reads

ACCEPTED_TRAINING = {
    "deepest": with_(training(), (*MAC, 0, "extra"), nested(64 - AT_MESSAGE - 1, {})),  # 64 deep
    "emoji and escapes": with_(training(), (*MAC, 0, "content"), "\U0001f600 \u00e9 \u2028 \\"),
    "NUL in text": with_(training(), (*MAC, 0, "content"), "a\x00b"),
    "big integer": with_(training(), (*MAC, 0, "n"), 10**4000),
    "tiny float": with_(training(), (*MAC, 0, "x"), 5e-324),
    "large float": with_(training(), (*MAC, 0, "x"), 1.7976931348623157e308),
    "duplicate key": None,  # raw, below
    "NAT, nested metadata": with_(
        nat_training(), (*EPISODE, 1, "metadata"), {"tool_calls": [], "x": nested(30, {})}
    ),
    "NAT, emoji": with_(nat_training(), (*EPISODE, 1, "content"), "\U0001f600"),
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", list(ACCEPTED_TRAINING))
async def test_what_the_api_accepts_the_worker_decodes(live, database_url, name, size) -> None:
    body = ACCEPTED_TRAINING[name]
    raw = (
        text_of(body).encode()
        if body is not None
        else (text_of(training())[:-1] + ', "model": "agent"}').encode()
    )
    response = await post(live.client, "/v1/training-jobs", raw, size)
    assert response.status_code == 202, response.text
    payload = await stored_payload(database_url, response.json()["id"])
    assert payload.format == training_spec.V1
    groups = training_spec.decode(payload)  # real art.TrajectoryGroups, as the worker builds
    assert len(groups) == 1 and len(groups[0].trajectories) == 2


ACCEPTED_ROLLOUTS = {
    "deep messages": with_(rollout(), ("examples", 0, "messages", 0, "x"), nested(29, {})),
    "emoji": with_(rollout(), ("examples", 0, "messages", 0, "content"), "\U0001f600"),
    "big integer id": with_(rollout(), ("examples", 0, "id"), 2**63 - 1),  # the largest
    "expected, nested": with_(rollout(), ("examples", 0, "expected"), {"a": nested(20)}),
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", list(ACCEPTED_ROLLOUTS))
async def test_what_the_api_accepts_the_rollout_worker_decodes(live, database_url, name, size):
    body = ACCEPTED_ROLLOUTS[name]
    response = await post(live.client, "/v1/rollout-jobs", body, size)
    assert response.status_code == 202, response.text
    recipe = rollout_spec.decode(await stored_payload(database_url, response.json()["id"]))
    sent = Example.model_validate(json.loads(text_of(body["examples"][0])))
    assert recipe.examples == [sent]


# ---------------------------------------------------------------------------------- limits


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(
    ("body", "path", "setting"),
    [
        (training(groups=f.art_groups([[1.0, 0.0]] * 4)), "groups", "MAX_GROUPS_PER_JOB"),
        (
            {"model": "agent", "collection": f.nat_collection([[1.0, 0.0]] * 4)},
            "collection.trajectories",
            "MAX_GROUPS_PER_JOB",
        ),
        (
            training(groups=f.art_groups([[1.0, 0.0, 1.0, 0.0]])),
            "groups[0].trajectories",
            "MAX_TRAJECTORIES_PER_GROUP",
        ),
        (
            {"model": "agent", "collection": f.nat_collection([[1.0, 0.0, 1.0, 0.0]])},
            "collection.trajectories[0]",
            "MAX_TRAJECTORIES_PER_GROUP",
        ),
        (
            with_(
                training(), MAC, [{"role": "user", "content": "x"}] * 9 + [f.art_choice("a", [1])]
            ),
            "groups[0].trajectories[0].messages_and_choices",
            "MAX_ITEMS_PER_TRAJECTORY",
        ),
        (
            with_(training(), ("groups", 0, "trajectories", 0, "tools"), [{}] * 9),
            "groups[0].trajectories[0].tools",
            "MAX_ITEMS_PER_TRAJECTORY",
        ),
        (
            with_(nat_training(), EPISODE, [f.nat_item("user", "x")] * 9),
            "collection.trajectories[0][0].episode",
            "MAX_ITEMS_PER_TRAJECTORY",
        ),
        (training(groups=f.art_groups([[1.0, 0.0]] * 3)), "", "MAX_LOGPROB_TOKENS_PER_JOB"),
        (  # one token with many alternatives
            with_(
                training(),
                (*MAC, 1, "logprobs", "content", 0, "top_logprobs"),
                [{"token": "a", "logprob": -1.0}] * 20,
            ),
            "",
            "MAX_LOGPROB_TOKENS_PER_JOB",
        ),
        (
            with_(rollout(), ("examples", 0, "messages"), [{"role": "user", "content": "x"}] * 9),
            "examples[0].messages",
            "MAX_ITEMS_PER_TRAJECTORY",
        ),
    ],
)
async def test_counts_past_the_limits_are_413_naming_the_limit(
    serve, database_url, body, path, setting, size
) -> None:
    limits = {
        "max_groups_per_job": 3,
        "max_trajectories_per_group": 3,
        "max_items_per_trajectory": 8,
        "max_logprob_tokens_per_job": 11,  # each choice of the factories has 2 tokens + 2 top
    }
    async with serve(**limits) as live:
        await f.create_model(live.client)
        await register_served_model(live)
        before = await stored(database_url)
        url = "/v1/rollout-jobs" if "examples" in body else "/v1/training-jobs"
        answer = problem(await post(live.client, url, body, size), 413)
        assert answer["type"] == "urn:trainyard:problem:limit-exceeded"
        error = answer["errors"][0]
        assert error["path"] == path and f"TRAINYARD_{setting}" in error["message"]
        assert await stored(database_url) == before
        # At the limit it is accepted.
        assert (await post(live.client, "/v1/training-jobs", training())).status_code == 202


async def test_free_form_objects_are_capped(live, database_url) -> None:
    before = await stored(database_url)
    big = {"k": "x" * 70_000}
    for url, body, path in [
        ("/v1/training-jobs", training(metadata=big), "metadata"),
        ("/v1/training-jobs", training(hyperparameters=big), "hyperparameters"),
        ("/v1/models", f.model_body("m2", **big), "config"),
        ("/v1/rollout-jobs", rollout(metadata=big), "metadata"),
    ]:
        answer = problem(await post(live.client, url, body), 422)
        assert paths_of(answer) == [path]
        assert "larger than 65536 bytes" in answer["errors"][0]["message"]
    assert await stored(database_url) == before


def many_wrong_rewards() -> dict[str, Any]:
    groups = f.art_groups([[1.0, 0.0]] * 400)
    for group in groups:
        for trajectory in group["trajectories"]:
            trajectory["reward"] = "high"
    return training(groups=groups)


def many_wrong_nat_rewards() -> dict[str, Any]:
    body = {"model": "agent", "collection": f.nat_collection([[1.0, 0.0]] * 400)}
    for group in body["collection"]["trajectories"]:
        for trajectory in group:
            trajectory["reward"] = "high"
    return body


def many_wrong_examples() -> dict[str, Any]:
    examples = [{"id": {}, "messages": [{"role": "user", "content": "x"}]} for _ in range(400)]
    return rollout(examples=examples)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(
    ("url", "build", "first"),
    [
        (
            "/v1/training-jobs",
            many_wrong_rewards,
            ["groups[0].trajectories[0].reward", "groups[0].trajectories[1].reward"],
        ),
        (
            "/v1/training-jobs",
            many_wrong_nat_rewards,
            ["collection.trajectories[0][0].reward", "collection.trajectories[0][1].reward"],
        ),
        (
            "/v1/rollout-jobs",
            many_wrong_examples,
            ["examples[0].id", "examples[0].id"],
        ),
    ],
)
async def test_a_body_of_many_errors_lists_the_first_hundred(
    live, database_url, url, build, first, size
) -> None:
    before = await stored(database_url)
    answer = problem(await post(live.client, url, build(), size), 422)
    assert len(answer["errors"]) == 100
    assert answer["detail"].startswith("more than 100 invalid fields")
    assert paths_of(answer)[:2] == first
    assert await stored(database_url) == before


# ------------------------------------------------------------- logprobs, idempotency keys


@pytest.mark.parametrize(
    ("body", "path"),
    [
        (
            with_(training(), (*MAC, 1, "logprobs", "content", 0, "logprob"), 0.5),
            "groups[0].trajectories[0].messages_and_choices[1].logprobs.content[0].logprob",
        ),
        (
            with_(
                training(), (*MAC, 1, "logprobs", "content", 1, "top_logprobs", 0, "logprob"), 1e-9
            ),
            "groups[0].trajectories[0].messages_and_choices[1].logprobs.content[1].top_logprobs[0].logprob",
        ),
        (
            with_(nat_training(), (*EPISODE, 2, "logprobs", "content", 0, "logprob"), 3),
            "collection.trajectories[0][0].episode[2].logprobs.content[0].logprob",
        ),
        (
            with_(training(), (*MAC, 1, "logprobs", "refusal"), [{"token": "a", "logprob": 2.0}]),
            "groups[0].trajectories[0].messages_and_choices[1].logprobs.refusal[0].logprob",
        ),
    ],
)
async def test_a_positive_logprob_is_422_at_its_path(live, database_url, body, path) -> None:
    before = await stored(database_url)
    answer = problem(await post(live.client, "/v1/training-jobs", body), 422)
    assert paths_of(answer) == [path]
    assert "at most 0" in answer["errors"][0]["message"]
    assert await stored(database_url) == before


async def test_zero_logprobs_are_certain_tokens(live) -> None:
    for zero in (0, 0.0, -0.0):
        body = with_(training(), (*MAC, 1, "logprobs", "content", 0, "logprob"), zero)
        assert (await post(live.client, "/v1/training-jobs", body)).status_code == 202


@pytest.mark.parametrize("key", [""])
async def test_an_empty_idempotency_key_is_422(live, database_url, key) -> None:
    before = await stored(database_url)
    response = await post(live.client, "/v1/training-jobs", training(), **{"Idempotency-Key": key})
    [error] = problem(response, 422)["errors"]
    assert (error["location"], error["path"]) == ("header", "Idempotency-Key")
    assert await stored(database_url) == before
    response = await post(live.client, "/v1/training-jobs", training(), **{"Idempotency-Key": "k"})
    assert response.status_code == 202


# ------------------------------------------------------------------- one reader, every body


def test_no_route_lets_fastapi_read_its_body(tmp_path) -> None:
    """Every JSON body goes through `app.api.body`: FastAPI's own reader would accept what
    the strict one refuses."""
    from fastapi.routing import APIRoute

    from app.main import create_app
    from app.settings import Settings

    def routes(router: Any) -> list[APIRoute]:
        found = []
        for route in router.routes:
            if isinstance(route, APIRoute):
                found.append(route)
            elif hasattr(route, "original_router"):  # an included router
                found += routes(route.original_router)
        return found

    app = create_app(Settings(database_url=f"sqlite+aiosqlite:///{tmp_path}/x.db"))
    every = routes(app.router)
    assert len(every) > 20
    assert [r.path for r in every if r.body_field is not None] == []
    documented = {
        path
        for path, item in app.openapi()["paths"].items()
        for op in item.values()
        if "requestBody" in op
    }
    assert documented == {
        "/v1/models",
        "/v1/training-jobs",
        "/v1/rollout-jobs",
        "/v1/evaluation-jobs",
        "/v1/runs",
        "/v1/run-estimates",
        "/v1/datasets",
        "/v1/models/{name}/aliases/{alias}",
        "/v1/models/{name}/retention",
        "/v1/webhooks",
        "/v1/webhooks/{endpoint_id}",
        "/v1/projects",
        "/v1/projects/{project_id}/keys",
        "/v1/projects/{project_id}/quotas",
        "/openai/v1/chat/completions",
    }


async def test_the_gateway_refuses_a_lone_surrogate_in_its_envelope(live) -> None:
    raw = text_of({"model": "toy", "messages": [{"role": "user", "content": "\ud800"}]})
    response = await live.client.post("/openai/v1/chat/completions", content=raw, headers=JSON)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_json" and "messages[0].content" in error["message"]
