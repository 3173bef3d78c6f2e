"""Dataset uploads over real HTTP: identifiers checked (ids, split names, dataset names),
examples a rollout can use, JSON Lines in UTF-8 only, every refusal naming its line and
field and storing nothing; a large upload read off the event loop is stored whole."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.backends.tiny_model import make_tiny_model
from app.datasets import INLINE_BYTES, load_splits
from tests.conftest import LiveServer

JSONL = {"Content-Type": "application/jsonl"}
USER = [{"role": "user", "content": "hi"}]


def line(**fields: Any) -> bytes:
    return json.dumps({"id": "e", "messages": USER, **fields}).encode()


def good(i: int) -> bytes:
    return line(id=f"good-{i}")


async def datasets(live: LiveServer) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = (await live.client.get("/v1/datasets")).json()["data"]
    return data


BAD_LINES = {
    "split ..": (line(split=".."), "split"),
    "split .": (line(split="."), "split"),
    "split __proto__": (line(split="__proto__"), "split"),
    "split with /": (line(split="a/b"), "split"),
    "split of 65 characters": (line(split="s" * 65), "split"),
    "empty split": (line(split=""), "split"),
    "id of 100,000 characters": (line(id="i" * 100_000), "id"),
    "empty id": (line(id=""), "id"),
    "id with a newline": (line(id="a\nb"), "id"),
    "id with a control character": (line(id="a\x1bb"), "id"),
    "integer id past 64 bits": (line(id=2**64), "id"),
    "no user or system turn": (
        line(messages=[{"role": "assistant", "content": "4"}]),
        "messages",
    ),
    "only tool turns": (
        line(messages=[{"role": "tool", "content": "x", "tool_call_id": "c"}]),
        "messages",
    ),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
async def test_a_bad_identifier_or_prompt_names_its_line_and_field(
    live: LiveServer, case: str, large: bool
) -> None:
    bad, field = BAD_LINES[case]
    before = [good(i) for i in range(2)]
    after = [good(i) for i in range(2, 2 + (2000 if large else 1))]  # large: read in a thread
    body = b"\n".join([*before, bad, *after]) + b"\n"
    assert len(body) > INLINE_BYTES or not large
    response = await live.client.post("/v1/datasets?name=bad", content=body, headers=JSONL)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    errors = response.json()["errors"]
    assert [e["path"] for e in errors] == [f"line[3].{field}"], errors
    assert await datasets(live) == []


async def test_an_id_given_twice_names_both_lines(live: LiveServer) -> None:
    body = b"\n".join([good(0), line(id="same"), good(1), line(id="same"), line(id=7), good(2)])
    body += b"\n" + line(id="7")  # the same id as text: a rollout keys examples by it
    response = await live.client.post("/v1/datasets?name=dup", content=body, headers=JSONL)
    assert response.status_code == 422, response.text
    errors = response.json()["errors"]
    assert [(e["path"], e["type"]) for e in errors] == [
        ("line[4].id", "duplicate_id"),
        ("line[7].id", "duplicate_id"),
    ]
    assert "line 2" in errors[0]["message"] and "line 5" in errors[1]["message"]
    assert await datasets(live) == []
    # The same ids in other splits are the same ids.
    split = b"\n".join([line(id="a"), line(id="a", split="validation")])
    again = await live.client.post("/v1/datasets?name=dup", content=split, headers=JSONL)
    assert again.status_code == 422 and again.json()["errors"][0]["path"] == "line[2].id"


async def test_identifiers_at_their_limits_are_taken(live: LiveServer) -> None:
    body = b"\n".join(
        [
            line(id="i" * 256, split="s" * 64),
            line(id=-(2**63), split="v1.2-x_y"),
            line(id=2**63 - 1, messages=[{"role": "system", "content": "be brief"}]),
            line(id="é — 例", messages=[{"role": "developer", "content": "x"}]),
        ]
    )
    response = await live.client.post("/v1/datasets?name=edge", content=body, headers=JSONL)
    assert response.status_code == 201, response.text
    assert response.json()["splits"] == {"s" * 64: 1, "v1.2-x_y": 1, "train": 2}


@pytest.mark.parametrize("name", ["..", ".", "__proto__", "a/b", "-x", "n" * 129, ""])
async def test_a_bad_dataset_name_is_refused(live: LiveServer, name: str) -> None:
    response = await live.client.post(
        "/v1/datasets", params={"name": name}, content=good(0), headers=JSONL
    )
    assert response.status_code == 422, response.text
    assert [e["path"] for e in response.json()["errors"]] == ["name"]
    assert await datasets(live) == []


@pytest.mark.parametrize(
    "content_type",
    [
        "application/jsonl; charset=latin-1",
        "application/x-ndjson; charset=utf-16",
        "text/plain; charset=ISO-8859-1",
        'application/jsonl; charset="windows-1252"',
    ],
)
async def test_json_lines_in_another_charset_are_refused(
    live: LiveServer, content_type: str
) -> None:
    response = await live.client.post(
        "/v1/datasets?name=cs", content=good(0), headers={"Content-Type": content_type}
    )
    assert response.status_code == 422, response.text
    assert [(e["location"], e["path"], e["type"]) for e in response.json()["errors"]] == [
        ("header", "content-type", "charset")
    ]
    assert await datasets(live) == []


@pytest.mark.parametrize(
    "content_type",
    ["application/jsonl; charset=utf-8", "text/plain; charset=UTF8", "application/x-ndjson"],
)
async def test_json_lines_in_utf8_are_taken(live: LiveServer, content_type: str) -> None:
    response = await live.client.post(
        "/v1/datasets?name=cs", content=good(0), headers={"Content-Type": content_type}
    )
    assert response.status_code == 201, response.text


async def test_a_large_upload_of_many_small_messages_is_stored_whole(live: LiveServer) -> None:
    """Read off the event loop (over `INLINE_BYTES`): what is stored is every line."""
    messages = [
        {"role": "user" if t % 2 == 0 else "assistant", "content": f"m{t}"} for t in range(2000)
    ]
    lines = [
        {"id": f"ex-{i}", "messages": messages, "expected": str(i), "split": split}
        for i, split in enumerate(["train"] * 30 + ["validation"] * 10)
    ]
    body = "\n".join(json.dumps(x) for x in lines).encode()
    assert len(body) > 10 * INLINE_BYTES
    first = await live.client.post("/v1/datasets?name=big", content=body, headers=JSONL)
    assert first.status_code == 201, first.text
    dataset = first.json()
    assert dataset["num_examples"] == 40
    assert dataset["splits"] == {"train": 30, "validation": 10}
    again = await live.client.post("/v1/datasets?name=big", content=body, headers=JSONL)
    assert again.status_code == 200 and again.json()["id"] == dataset["id"]
    async with live.app.state.engine.connect() as conn:
        splits = await load_splits(conn, dataset["id"])
    expected = {
        split: [
            {k: v for k, v in x.items() if k != "split"} | {"metadata": {}}
            for x in lines
            if x["split"] == split
        ]
        for split in ("train", "validation")
    }
    assert splits == expected


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        (b"\xef\xbb\xbf" + good(0), "line[1]"),  # a byte order mark
        (good(0) + b"\n" + line(expected="caf\xe9").replace(b"\\u00e9", b"\xe9"), "line[2]"),
        (
            good(0) + b"\n" + b'{"id": "s", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "line[2].messages[0].content",
        ),
        (
            good(0) + b"\n" + b'{"id": "n", "messages": [{"role": "user"}], "expected": NaN}',
            "line[2].expected",
        ),
        (
            good(0)
            + b"\n"
            + b'{"id": "d", "messages": [{"role": "user"}], "expected": '
            + b"[" * 400
            + b"]" * 400
            + b"}",
            "line[2].expected",
        ),
    ],
    ids=["bom", "latin-1 bytes", "lone surrogate", "NaN", "400 levels"],
)
async def test_text_the_worker_could_not_read_names_its_line(
    live: LiveServer, raw: bytes, path: str
) -> None:
    response = await live.client.post("/v1/datasets?name=text", content=raw, headers=JSONL)
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["path"].startswith(path), response.json()
    assert await datasets(live) == []


@pytest.mark.torch
async def test_a_runs_inline_examples_are_checked_as_a_datasets_lines(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    model = make_tiny_model(tmp_path / "models" / "tiny")
    async with serve(model_roots=[model.parent], demo_model=True) as live:
        examples = [
            {"id": "a", "messages": USER, "expected": "1"},
            {"id": "b", "messages": USER, "expected": "1", "split": ".."},
            {"id": "a", "messages": USER, "expected": "1"},
            {"id": "c" * 300, "messages": USER, "expected": "1"},
            {"id": "d", "messages": [{"role": "assistant", "content": "1"}], "expected": "1"},
        ]
        body = {
            "model": "demo",
            "examples": examples,
            "recipe": {"num_generations": 2, "grader": {"type": "exact_match"}},
            "schedule": {"max_steps": 1},
        }
        response = await live.client.post("/v1/runs", json=body)
        assert response.status_code == 422, response.text
        paths = [e["path"] for e in response.json()["errors"]]
        # The repeated id (the service's check) is listed after the schema's errors.
        assert paths == [
            "examples[1].split",
            "examples[3].id",
            "examples[4].messages",
            "examples[2].id",
        ]
        del examples[4], examples[3], examples[1]
        twice = await live.client.post("/v1/runs", json=body)
        assert twice.status_code == 422, twice.text
        assert [(e["path"], e["type"]) for e in twice.json()["errors"]] == [
            ("examples[1].id", "duplicate_id")
        ]
        assert (await live.client.get("/v1/runs")).json()["data"] == []
