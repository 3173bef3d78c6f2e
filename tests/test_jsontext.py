"""The edge's JSON reader and writer against the standard library, and validation a piece
at a time against validating whole.

`app.ingest.jsontext.loads` must read exactly what `json.loads` reads (values, and for broken
text the same message at the same character), apart from what it refuses on purpose; it
is run with windows of a few characters, so that every path through it is taken.
`dumps` must write `app.db.json_dumps`'s text. `app.schemas.pieces.validate` must give the
model, or the errors (paths, messages, order), that validating the whole body gives.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import threading
import time
import weakref
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.db import json_dumps
from app.ingest import jsontext
from app.ingest.freeing import dispose, gc_paused
from app.rollouts import spec as rollout_spec
from app.schemas.jobs import TRAINING_PIECES, TrainingJobCreate
from app.schemas.pieces import at_body_paths, validate
from app.schemas.rollouts import ROLLOUT_PIECES, RolloutJobCreate
from app.training import spec as training_spec
from tests import factories as f
from tests.test_properties import art_group_lists, json_values, nat_collections, paths, replace

CI = bool(os.environ.get("CI"))
PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=CI,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # `windows`: the same for every example
    ],
)

text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=8) | st.sampled_from(
    ['"', "\\", ",", "]", "}", "[{", "\U0001f600", "\u2028", "\x00", "NaN", "1e999"]
)
documents = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**1024)
    | st.floats(allow_nan=False, allow_infinity=False)
    | text,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(text, inner, max_size=6),
    max_leaves=40,
)


@pytest.fixture(params=[(16, 2), (64, 8), (1024, 32)], ids=["tiny", "small", "medium"])
def windows(request, monkeypatch) -> None:
    """Windows so small that every container is read both ways: whole, and walked."""
    chunk, first = request.param
    monkeypatch.setattr(jsontext, "CHUNK", chunk)
    monkeypatch.setattr(jsontext, "_FIRST_WINDOW", first)


def outcome(parse: Any, text: str) -> Any:
    try:
        return ("value", parse(text))
    except json.JSONDecodeError as exc:
        return ("error", exc.msg, exc.pos)
    except jsontext.JsonTextError as exc:
        return ("error", exc.message, exc.pos)
    except jsontext.JsonValueErrors:
        return ("refused",)


def strict(text: str) -> Any:
    return jsontext.loads(text.encode("utf-8"), max_depth=64)


@PROPERTY
@given(documents, st.sampled_from([None, 0, 2]), st.booleans())
def test_loads_reads_what_json_loads_reads(windows, document, indent, ascii_only) -> None:
    text = json.dumps(document, indent=indent, ensure_ascii=ascii_only)
    assert strict(text) == json.loads(text)


@PROPERTY
@given(documents, st.data())
def test_broken_text_breaks_at_the_same_character_with_the_same_message(
    windows, document, data
) -> None:
    text = json.dumps(document)
    at = data.draw(st.integers(0, len(text)))
    broken = data.draw(
        st.sampled_from(
            [
                text[:at] + text[at + 1 :],
                text[:at],
                *(text[:at] + c + text[at:] for c in ',:[]{}"1 \\x'),
            ]
        )
    )
    expected = outcome(json.loads, broken)
    got = outcome(strict, broken)
    if got != expected:  # only what the checks refuse on purpose, and only then
        assert got == ("refused",) and expected[0] == "value"
        assert list(jsontext._problems(expected[1]))


@pytest.mark.parametrize(
    ("text", "path", "kind"),
    [
        ('{"a": "\\ud800"}', ("a",), "string_unicode"),
        ('{"a": ["x", "\\udfff"]}', ("a", 1), "string_unicode"),
        ('{"\\udc00": 1}', ("\\udc00",), "string_unicode"),
        ('["\\ude00\\ud83d"]', (0,), "string_unicode"),
        ('["\\ud83d"]', (0,), "string_unicode"),
        ("[NaN]", (0,), "finite_number"),
        ('{"x": -Infinity}', ("x",), "finite_number"),
        ("[1e309]", (0,), "finite_number"),
        ("[-1" + "0" * 400 + ".5]", (0,), "finite_number"),
    ],
)
def test_values_no_json_reader_keeps_are_refused_at_their_path(windows, text, path, kind):
    with pytest.raises(jsontext.JsonValueErrors) as refused:
        strict(text)
    [error] = refused.value.errors
    assert (error.path, error.type) == (path, kind)


@pytest.mark.parametrize(
    "text",
    ['["\\ud83d\\ude00"]', '["NaN", "Infinity"]', "[1e308, 1e-999, 10e-400]", '["\\\\ud800"]'],
)
def test_what_only_looks_suspect_is_read(windows, text) -> None:
    assert strict(text) == json.loads(text)


@pytest.mark.parametrize("depth", [64, 65, 1000, 50_000])
def test_depth(windows, depth) -> None:
    text = "[" * depth + "]" * depth
    if depth <= 64:
        assert strict(text) == json.loads(text)
        return
    with pytest.raises(jsontext.JsonTextError) as refused:
        strict(text)
    assert refused.value.type == "json_too_deep" and refused.value.path == (0,) * 64


@PROPERTY
@given(documents | st.builds(lambda v: [v, math.nan, {"x": math.inf}], documents))
def test_dumps_writes_json_dumps_text(document) -> None:
    for piece in (2, 8, 4096):
        jsontext.PIECE, saved = piece, jsontext.PIECE
        try:
            assert jsontext.dumps(document) == json_dumps(document)
        finally:
            jsontext.PIECE = saved


def test_a_thread_reading_a_large_text_lets_other_threads_run() -> None:
    """The point of reading a piece at a time: no call holds the GIL for long."""
    text = json.dumps({"model": "m", "groups": f.art_groups([[1.0, 0.0]] * 8000)}).encode()
    gaps: list[float] = []
    done = threading.Event()

    def read() -> None:
        with gc_paused():  # as the API reads a large body
            jsontext.loads(text, max_depth=64)
        done.set()

    worker = threading.Thread(target=read)
    last = begin = time.perf_counter()
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    took = time.perf_counter() - begin
    assert len(text) > 5_000_000 and len(gaps) > 10
    # Read in one call, the longest gap would be the whole read (gap ≈ took); a piece at a
    # time, a few switch intervals however loaded the machine.
    assert max(gaps) < max(0.5, took / 2), (max(gaps), took)


# --------------------------------------------------------------------------- pieces


def errors_of(model: Any, document: Any) -> list[tuple[Any, ...]]:
    """The errors of validating `document` whole, at the paths of the body (a union's
    branch left out, as `validate` reports them)."""
    try:
        model.model_validate(json.loads(json.dumps(document)), from_attributes=True)
    except Exception as exc:  # a ValidationError
        errors = at_body_paths(exc.errors(include_url=False), document)
        return [(tuple(e["loc"]), e["msg"], e["type"]) for e in errors]
    return []


def pieced(model: Any, document: Any, pieces: Any, max_errors: int = 10_000) -> Any:
    body, errors, more = validate(model, json.loads(json.dumps(document)), pieces, max_errors)
    return body, [(tuple(e["loc"]), e["msg"], e["type"]) for e in errors], more


def training_bodies() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        art_group_lists().map(lambda groups: {"model": "m", "groups": groups}),
        nat_collections().map(lambda collection: {"model": "m", "collection": collection}),
    )


@PROPERTY
@given(training_bodies(), st.data(), json_values)
def test_validating_a_piece_at_a_time_gives_the_errors_of_validating_whole(
    document, data, value
) -> None:
    for _ in range(data.draw(st.integers(0, 3))):
        document = replace(document, data.draw(st.sampled_from(paths(document))), value)
    whole = errors_of(TrainingJobCreate, document)
    body, errors, more = pieced(TrainingJobCreate, document, TRAINING_PIECES)
    assert errors == whole and not more
    if not whole:
        assert body == TrainingJobCreate.model_validate(document)
    cut = data.draw(st.integers(1, 5))
    _, first, _ = pieced(TrainingJobCreate, document, TRAINING_PIECES, max_errors=cut)
    assert first == whole[: len(first)] and (len(first) == min(cut, len(whole)))


@PROPERTY
@given(art_group_lists())
def test_the_stored_groups_are_the_models_json(groups) -> None:
    body = TrainingJobCreate.model_validate({"model": "m", "groups": groups})
    assert training_spec.groups_of(body) == [g.model_dump(mode="json") for g in body.groups]


@PROPERTY
@given(st.lists(json_values, min_size=1, max_size=4), st.data())
def test_a_rollout_spec_stores_its_examples_as_their_json(values, data) -> None:
    examples = [
        {"id": i, "messages": [{"role": "user", "content": "q", "x": v}], "expected": v}
        for i, v in enumerate(values)
    ]
    document = {"model": "m", "examples": examples, "grader": {"type": "exact_match"}}
    body, errors, _ = pieced(RolloutJobCreate, document, ROLLOUT_PIECES)
    assert errors == errors_of(RolloutJobCreate, document)
    if body is None:
        return
    recipe = rollout_spec.RolloutSpec.of(body)
    payload = rollout_spec.encode(
        recipe.model_copy(update={"examples": []}), rollout_spec.examples_json(body.examples)
    )
    assert payload.size == len(json_dumps(recipe.model_dump(mode="json")))
    assert rollout_spec.decode(payload) == recipe


def test_dispose_frees_in_the_background_and_leaves_what_others_keep() -> None:
    class Leaf:
        pass

    leaf = Leaf()
    freed = weakref.ref(leaf)
    kept = {"a": [1, 2]}
    values: list[Any] = [{"x": [leaf, {"y": kept}], "z": kept}, [[leaf]]]
    del leaf
    assert gc.isenabled()
    dispose(values)
    assert values == []
    deadline = time.monotonic() + 5
    while freed() is not None or not gc.isenabled():  # paused until the disposer is done
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert kept == {"a": [1, 2]}


def test_dispose_takes_dataclasses_and_tuples_apart_and_leaves_classes_alone() -> None:
    """What a route prepares (a frozen dataclass holding tuples, dicts and lists) is taken
    apart a container at a time in the disposer's thread; a class it refers to is left."""
    freed_in: list[str] = []

    class Leaf:
        def __del__(self) -> None:
            freed_in.append(threading.current_thread().name)

    @dataclasses.dataclass(frozen=True)
    class Prepared:
        body: Any
        kind: type

    prepared = Prepared(body=({"examples": [Leaf()]},), kind=Leaf)
    fields = vars(prepared)  # stays with this test: cleared only if taken apart
    dispose([prepared])
    time.sleep(0.2)
    assert freed_in == [] and fields["kind"] is Leaf  # still held here: left as it is
    held = [prepared]
    del prepared
    dispose(held)
    deadline = time.monotonic() + 5
    while not freed_in or not gc.isenabled():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert fields == {}
    assert freed_in[0].startswith("dispose"), freed_in
    assert vars(Leaf)["__del__"]  # the class kept its attributes
