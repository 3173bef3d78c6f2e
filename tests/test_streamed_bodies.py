"""A large training body is read a group at a time (`StreamedGroups`): what it makes of a
valid body is what reading it whole makes, byte for byte; a body with anything to report
is read whole, so its answer is the same as ever; and the groups never exist all at once.

Each body here is over `INLINE_BYTES`, the size from which a body is streamed.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import tracemalloc
from typing import Any

import pytest

from app.api import body as reading_body
from app.api.training_jobs import READING
from app.errors import ProblemError
from app.jobs.payloads import FEED, decompress
from app.settings import Settings
from app.training.service import Prepared
from tests import factories as f

WHOLE = dataclasses.replace(READING, stream=None)
GROUPS = 120


def art_body(groups: int = GROUPS, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "agent", "groups": f.art_groups([[1.0, 0.0]] * groups)}
    for g, group in enumerate(body["groups"]):
        for t, trajectory in enumerate(group["trajectories"]):
            trajectory["messages_and_choices"][1] = f.art_choice(
                f"answer {g} {t} é ✓", [(g + t + i) % 500 for i in range(20)]
            )
            trajectory["metrics"] = {"turns": 2, "score": 0.5}
            trajectory["tools"] = [
                {"type": "function", "function": {"name": "lookup", "parameters": {}}}
            ]
    return {**body, **fields}


def nat_body(groups: int = GROUPS, **fields: Any) -> dict[str, Any]:
    collection = f.nat_collection([[1.0, 0.5]] * groups)
    for g, group in enumerate(collection["trajectories"]):
        for trajectory in group:
            trajectory["episode"][-1]["logprobs"] = f.logprobs([(g + i) % 500 for i in range(20)])
            trajectory["metadata"] = {"example": g, "tags": ["a", "b"]}
    # run_id before the groups: the keys around a streamed list come in any order
    collection = {"run_id": collection["run_id"], "trajectories": collection["trajectories"]}
    return {"collection": collection, "model": "agent", **fields}


def read(raw: bytes, reading: Any = READING, settings: Settings | None = None) -> Any:
    return reading_body._read(raw, "application/json", reading, settings or Settings())


def streamed(raw: bytes, settings: Settings | None = None) -> Prepared | ProblemError | None:
    settings = settings or Settings()
    return reading_body._read_streamed(raw, READING, READING.stream(settings), settings, [])


def outcome(value: Any) -> Any:
    """What an answer is made of: a problem's status, detail and errors; a prepared job's
    fields, with its spec as the text that was compressed."""
    if isinstance(value, ProblemError):
        return type(value), value.status, value.detail, value.errors
    assert isinstance(value, Prepared), value
    spec = decompress(value.payload.data, value.payload.size) if value.payload else None
    return dataclasses.replace(value, payload=None), spec


def text(body: Any, **dumps: Any) -> bytes:
    raw = json.dumps(body, **dumps).encode()
    assert len(raw) > reading_body.INLINE_BYTES
    return raw


VALID = {
    "ART groups, fields after them": art_body(
        hyperparameters={"learning_rate": 1e-5},
        metadata={"experiment": "x"},
        policy_step=3,
        max_steps_off_policy=1,
    ),
    "ART groups, untrainable ones": {
        **art_body(),
        "groups": [
            *art_body(3)["groups"],
            {"trajectories": art_body(1)["groups"][0]["trajectories"][:1]},
        ]
        * 40,
    },
    "NAT collection": nat_body(metadata={"epoch": 1}),
}


@pytest.mark.parametrize("name", list(VALID))
@pytest.mark.parametrize("indent", [None, 1])
def test_a_valid_body_streamed_is_what_it_is_read_whole(name: str, indent: int | None) -> None:
    raw = text(VALID[name], indent=indent)
    prepared = streamed(raw)
    assert prepared is not None, "the body was not streamed"
    whole = read(raw, WHOLE)
    assert outcome(prepared) == outcome(whole)
    assert prepared.payload == whole.payload  # the same text in the same frame
    assert prepared.errors == [] and prepared.summary.num_groups > 0
    assert outcome(read(raw)) == outcome(whole)


def last_group(body: dict[str, Any], change: Any) -> dict[str, Any]:
    groups = body["groups"] if "groups" in body else body["collection"]["trajectories"]
    change(groups[-1])
    return body


def without_logprobs(group: Any) -> None:
    if isinstance(group, dict):
        group["trajectories"][0]["messages_and_choices"][1]["logprobs"] = None
    else:
        group[0]["episode"][-1]["logprobs"] = None


REPORTED = {
    # Each has something to report: the stream gives up and the whole body answers.
    "a wrong field in the last group": lambda: last_group(
        art_body(), lambda g: g["trajectories"][1].update(reward="high")
    ),
    "a NAT trajectory without logprobs": lambda: last_group(nat_body(), without_logprobs),
    "an ART choice without logprobs": lambda: last_group(art_body(), without_logprobs),
    "no logprobs, and the job opts out": lambda: last_group(
        art_body(hyperparameters={"allow_training_without_logprobs": True}), without_logprobs
    ),
    "a valid body that opts out of logprobs": lambda: art_body(
        hyperparameters={"allow_training_without_logprobs": True}
    ),
    "an unknown field after the groups": lambda: art_body(model=5, colour="red"),
    "groups and a collection": lambda: {**art_body(), "collection": nat_body()["collection"]},
    "a collection without run_id": lambda: {
        "model": "agent",
        "collection": {"trajectories": nat_body()["collection"]["trajectories"]},
    },
    "max_steps_off_policy without policy_step": lambda: art_body(max_steps_off_policy=2),
    "an empty group": lambda: {
        **art_body(),
        "groups": [*art_body()["groups"], {"trajectories": []}],
    },
}


@pytest.mark.parametrize("name", list(REPORTED))
def test_a_body_with_something_to_report_is_answered_as_it_is_read_whole(name: str) -> None:
    raw = text(REPORTED[name]())
    assert streamed(raw) is None
    assert outcome(read(raw)) == outcome(read(raw, WHOLE))


def replaced(raw: bytes, old: bytes, new: bytes) -> bytes:
    assert raw.count(old) >= 1, old
    at = raw.rindex(old)
    return raw[:at] + new + raw[at + len(old) :]


TEXTS = {
    "NaN in the last group": lambda: replaced(text(art_body()), b'"reward": 0.0', b'"reward": NaN'),
    "a lone surrogate in the last group": lambda: replaced(
        text(art_body()), b'"answer', b'"\\ud800answer'
    ),
    "a number too large in the last group": lambda: replaced(
        text(art_body()), b'"reward": 0.0', b'"reward": 1e400'
    ),
    "no groups": lambda: b'{"model": "agent", "groups": [' + b" " * 70_000 + b"]}",
    "groups given twice, the first invalid": lambda: replaced(
        text(art_body()), b'"groups": [', b'"groups": [{"trajectories": 1}], "groups": ['
    ),
    "groups given twice, the last invalid": lambda: (
        text(art_body())[:-1] + b', "groups": [{"trajectories": 1}]}'
    ),
    "groups given twice, both valid": lambda: (
        text(art_body())[:-1] + b', "groups": ' + json.dumps(art_body(3)["groups"]).encode() + b"}"
    ),
    "groups given twice, the last not a list": lambda: text(art_body())[:-1] + b', "groups": 7}',
}


DEEP = "[" * 70 + "]" * 70  # past the default max_json_depth


def twice(body: dict[str, Any], then: str) -> bytes:
    """`body`'s text with more members at its end: keys it has given again."""
    return text(body)[:-1] + b", " + then.encode() + b"}"


def small_top_level() -> bytes:
    """Over INLINE_BYTES, under CHUNK characters: the whole reading scans the document in
    one call, which keeps the last of two keys and never sees the first one's depth."""
    body = art_body(2)
    body["groups"][0]["trajectories"][0]["messages_and_choices"][0]["content"] = "✓" * 30_000
    inner = json.dumps(body, ensure_ascii=False)[1:-1]
    return ('{"metadata": ' + DEEP + ", " + inner + ', "metadata": {}}').encode()


def small_collection() -> bytes:
    """A collection that fits one call of the scanner, in a large body."""
    collection = json.dumps(nat_body(2)["collection"])[:-1] + f', "run_id": {DEEP}, "run_id": "r"}}'
    metadata = json.dumps({f"k{i}": "x" * 60 for i in range(700)})
    hyperparameters = json.dumps({f"h{i}": "y" * 60 for i in range(300)})
    return (
        f'{{"model": "agent", "metadata": {metadata}, "hyperparameters": {hyperparameters}, '
        f'"collection": {collection}}}'
    ).encode()


def past_the_scanner_budget() -> bytes:
    """Groups that each miss the scanner's first window, until the parser walks every
    container: the last one gives a key twice, the first value too deep."""
    tiny = f.art_groups([[1.0, 0.0]])[0]
    big = json.loads(json.dumps(tiny))
    big["trajectories"][0]["messages_and_choices"][0]["content"] = "b" * 3230
    last = json.dumps(tiny)[:-1] + f', "metadata": {DEEP}, "metadata": {{}}}}'
    groups = ", ".join([json.dumps(g) for g in [tiny, big] * 80] + [last])
    return ('{"model": "agent", "groups": [' + groups + "]}").encode()


TEXTS.update(
    {
        # The last key counts: a streamed list given again, emptied or replaced.
        "groups given again, empty": lambda: twice(art_body(), '"groups": []'),
        "groups given again, streamed too": lambda: twice(
            art_body(), '"groups": ' + json.dumps(art_body()["groups"][:100])
        ),
        "groups given again as null, with an empty collection": lambda: twice(
            art_body(), '"groups": null, "collection": {"run_id": "r", "trajectories": []}'
        ),
        "the collection given again, empty": lambda: twice(
            nat_body(), '"collection": {"run_id": "r", "trajectories": []}'
        ),
        "the collection given again as null, with no groups": lambda: twice(
            nat_body(), '"collection": null, "groups": []'
        ),
        # The parse takes the same steps streamed or whole, so depth is checked the same.
        "a small document, a key given twice, the first too deep": small_top_level,
        "a small collection, a key given twice, the first too deep": small_collection,
    }
)


@pytest.mark.parametrize("name", list(TEXTS))
def test_a_text_the_parser_must_read_whole_is_answered_as_it_is_read_whole(name: str) -> None:
    raw = TEXTS[name]()
    assert len(raw) > reading_body.INLINE_BYTES
    assert streamed(raw) is None
    assert outcome(read(raw)) == outcome(read(raw, WHOLE))


@pytest.mark.parametrize(
    "broken",
    [
        lambda raw: raw[:-1],  # cut short
        lambda raw: raw + b" x",  # extra data
        lambda raw: replaced(raw, b'"score": 0.5}', b'"score": 0.5,}'),  # in the last group
        lambda raw: replaced(raw, b'"metrics"', b'"metrics" "'),  # in the last group
        lambda raw: raw[:-1] + b', "metadata": ' + b"[" * 200 + b"]" * 200 + b"}",  # too deep
    ],
)
def test_a_text_that_is_not_json_is_answered_from_the_streamed_reading(broken: Any) -> None:
    raw = broken(text(art_body()))
    answer = streamed(raw)  # not read again whole: every group before the fault was taken
    assert isinstance(answer, ProblemError) and answer.errors
    assert answer.errors[0].type in ("json_invalid", "json_too_deep"), answer.errors
    assert outcome(answer) == outcome(read(raw, WHOLE))


@pytest.mark.parametrize(
    ("name", "limits"),
    [
        ("too many groups", {"max_groups_per_job": GROUPS - 1}),
        ("too many trajectories", {"max_trajectories_per_group": 1}),
        ("too many items", {"max_items_per_trajectory": 1}),
        ("too many logprob entries", {"max_logprob_tokens_per_job": 1000}),
    ],
)
@pytest.mark.parametrize("make", [art_body, nat_body])
def test_a_body_over_a_limit_is_answered_413_as_it_is_read_whole(
    name: str, limits: dict[str, int], make: Any
) -> None:
    settings = Settings(**limits)
    raw = text(make())
    assert streamed(raw, settings) is None
    answer = read(raw, settings=settings)
    assert isinstance(answer, ProblemError) and answer.status == 413, outcome(answer)
    assert outcome(answer) == outcome(read(raw, WHOLE, settings))


def test_past_the_scanner_budget_depth_is_checked_as_when_read_whole() -> None:
    raw = past_the_scanner_budget()
    answer = streamed(raw)
    assert isinstance(answer, ProblemError) and answer.errors
    assert answer.errors[0].type == "json_too_deep", answer.errors
    assert outcome(answer) == outcome(read(raw, WHOLE))


def peak_allocated(raw: bytes, reading: Any) -> tuple[int, Any]:
    gc.collect()
    tracemalloc.start()
    try:
        answer = read(raw, reading)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, answer


@pytest.mark.parametrize("make", [art_body, nat_body])
def test_the_groups_never_exist_all_at_once(make: Any) -> None:
    raw = text(make(groups=500))  # about 3 MB
    streamed_peak, answer = peak_allocated(raw, READING)
    whole_peak, _ = peak_allocated(raw, WHOLE)
    assert isinstance(answer, Prepared) and answer.summary.num_groups == 500
    # The body decoded (one copy of it), the compressor's batch and its join (a FEED each),
    # the compressed spec and one group: measured 1.78x the body here, where read whole
    # it took 7.9-8.2x.
    assert streamed_peak < 1.5 * len(raw) + 2 * FEED, (streamed_peak, len(raw))
    assert whole_peak > 3 * streamed_peak, (whole_peak, streamed_peak)
