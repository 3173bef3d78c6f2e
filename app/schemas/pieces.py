"""Validating a large request body a piece at a time: each piece (a trajectory, a group)
in one short call, so a thread that validates it holds the GIL briefly at a time; the
errors (paths, order) are exactly those that validating it whole reports."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

M = TypeVar("M", bound=BaseModel)

EACH = "*"
"""In a `Piece`'s path: every item of the list there."""


@dataclass(frozen=True)
class Piece:
    """Items of a large body validated one at a time: every list at `path` (model field
    names, `EACH` for every item of a list), each of its items as `kind`. Pieces of a
    model are listed innermost first."""

    path: tuple[str, ...]  # ends with EACH
    kind: Any

    @cached_property
    def adapter(self) -> TypeAdapter[Any]:
        if isinstance(self.kind, type) and issubclass(self.kind, BaseModel):
            return TypeAdapter(self.kind)
        return TypeAdapter(self.kind, config=ConfigDict(strict=True))


class _StandIns:
    """Items that failed validation stand, in the body, for their errors: each as a bytes
    object of its own, which no model or list of a body accepts (a model fails on it once,
    at its place, as FastAPI's validation fails on any input it cannot read fields from),
    so validating what holds it fails there, and `expand` puts the errors back."""

    def __init__(self) -> None:
        self.errors: dict[int, tuple[bytes, list[dict[str, Any]]]] = {}

    def new(self, errors: list[dict[str, Any]]) -> bytes:
        stand_in = bytes(8)  # a new object each time
        self.errors[id(stand_in)] = (stand_in, errors)
        return stand_in

    def expand(self, errors: list[Any]) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = []
        seen: set[int] = set()
        for error in errors:
            stand_in = error.get("input")
            held = self.errors.get(id(stand_in)) if type(stand_in) is bytes else None
            if held is None or held[0] is not stand_in:
                result.append(error)
            elif id(stand_in) not in seen:
                seen.add(id(stand_in))
                result.extend({**inner, "loc": (*error["loc"], *inner["loc"])} for inner in held[1])
        return result


def validate(
    model: type[M], data: Any, pieces: Sequence[Piece] = (), max_errors: int = 100
) -> tuple[M | None, list[dict[str, Any]], bool]:
    """`model.model_validate(data, from_attributes=True)` (as FastAPI validates a body), a
    piece at a time: (the model, [], False), or (None, its errors as pydantic lists them,
    whether items were left unvalidated once `max_errors` were found). Replaces items of
    `data` in place."""
    found = 0
    more = False
    stand_ins = _StandIns()
    for piece in pieces:
        # Items that hold inner pieces are validated whatever was found: their own fields
        # are few, and they carry the inner pieces' errors out.
        outer = any(p.path[: len(piece.path)] == piece.path and p is not piece for p in pieces)
        for items in _lists(data, piece.path[:-1]):
            for i, item in enumerate(items):
                if found >= max_errors and not outer:
                    items[i] = stand_ins.new([])  # left unvalidated: fails, with no error
                    more = True
                    continue
                try:
                    items[i] = piece.adapter.validate_python(item, from_attributes=True)
                except ValidationError as exc:
                    errors = at_body_paths(stand_ins.expand(exc.errors(include_url=False)), item)
                    found += len(errors)
                    items[i] = stand_ins.new(errors)
    try:
        body = model.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        errors = at_body_paths(stand_ins.expand(exc.errors(include_url=False)), data)
        return None, errors[:max_errors], more
    # Items are left unvalidated only once errors were found, and those stay in the body.
    assert not more, "a body with unvalidated items passed validation"
    return body, [], False


def at_body_paths(errors: list[dict[str, Any]], body: Any) -> list[dict[str, Any]]:
    """`errors` with each `loc` made the path of a value in `body` (`body_loc`)."""
    return [
        {**error, "loc": body_loc(error["loc"], body, missing=error.get("type") == "missing")}
        for error in errors
    ]


def body_loc(
    loc: Sequence[str | int], body: Any, *, missing: bool = False
) -> tuple[str | int, ...]:
    """Pydantic's `loc` of an error as the path of the value in the body it validated.

    Inside a union, pydantic puts the branch it tried in the path: a discriminated union's
    tag (`grader.regex.pattern` for the body's `grader.pattern`), another union's type
    (`examples[0].id.str`). Those name nothing a client sent. Each part is kept where it
    names a key or an index of the body at that point, where it is the last part of a
    `missing` error under an object (the field that is missing), and where it is `[key]`
    (the key itself is wrong); any other part is a branch, and dropped. A stand-in of
    `validate` (bytes, no JSON value) holds a piece whose errors are already at body paths:
    the rest is kept as it is."""
    out: list[str | int] = []
    node = body
    for i, part in enumerate(loc):
        if type(node) is bytes:
            out.extend(loc[i:])
            break
        if part == "[key]":
            out.append(part)
            node = None
        elif (isinstance(node, dict) and isinstance(part, str) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        ):
            out.append(part)
            node = node[part]  # type: ignore[index]
        elif missing and isinstance(node, dict) and i == len(loc) - 1:
            out.append(part)  # a missing field
    return tuple(out)


def validate_item(item: Any, path: tuple[str, ...], pieces: Sequence[Piece]) -> Any | None:
    """An item of a list at `path` (a parsed body's, handed out alone: `app.ingest.jsontext`'s
    streams) validated as `validate` validates it inside the whole body, by the pieces at
    and under `path`'s items, innermost first: the validated item, or None at its first
    error (the body read whole reports them)."""
    holder = [item]
    under = (*path, EACH)
    for piece in pieces:
        if piece.path[: len(under)] != under:
            continue
        for items in _lists(holder, piece.path[len(path) : -1]):
            for i, value in enumerate(items):
                try:
                    items[i] = piece.adapter.validate_python(value, from_attributes=True)
                except ValidationError:
                    return None
    return holder[0]


def _lists(node: Any, path: tuple[str, ...]) -> Iterator[list[Any]]:
    if not path:
        if isinstance(node, list):
            yield node
        return
    head, rest = path[0], path[1:]
    if head == EACH:
        if isinstance(node, list):
            for item in node:
                yield from _lists(item, rest)
    elif isinstance(node, dict) and head in node:
        yield from _lists(node[head], rest)
