"""Datasets: examples uploaded once as JSON Lines and reused by runs, kept in named splits.

An upload is read a line at a time: each line is parsed strictly (`app.ingest.jsontext`) and
validated as a `DatasetExample`, and every error names its line (`line[3].messages[0]
.role`, lines counted from 1). Nothing is stored unless every line is valid. The same
bytes uploaded again under the same name give back the dataset stored the first time.

A large upload takes the path of large JSON bodies (`app.api.body.off_the_loop`): read,
checked, encoded and compressed in one thread with the garbage collector paused, each
line parsed a piece at a time and validated alone, what the lines were parsed into freed
in the background; the event loop gets back a few bytes objects (`Prepared`).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from app.db import begin_write, utcnow
from app.errors import (
    ConflictError,
    InvalidInputError,
    NotFoundError,
    ProblemError,
    format_path,
    not_found,
)
from app.ingest import jsontext
from app.ingest.freeing import dispose
from app.jobs.payloads import compress, decompress
from app.models import DEFAULT_PROJECT_ID, DatasetRow, JobRow
from app.schemas.common import FieldError
from app.schemas.runs import Dataset, DatasetExample

MAX_EXAMPLES = 100_000
MAX_ERRORS = 100
INLINE_BYTES = 64 * 1024  # uploads above this are read in a thread (as JSON bodies are)
THREAD_BYTES = 256 * 1024  # stored datasets above this are decoded in a thread


@dataclass(frozen=True)
class Prepared:
    """A valid upload as it is stored: its examples by split, encoded and compressed, and
    what the dataset says of them. Nothing in it is large in objects (a few bytes
    objects), so nothing of it holds the event loop when it is kept or freed."""

    sha256: str
    num_examples: int
    splits: dict[str, int]  # examples per split
    payload: bytes  # the compressed document (`jsontext.dumps_bytes` of the splits)
    payload_bytes: int  # the document's size


def read_jsonl(raw: bytes, *, max_depth: int) -> Prepared | ProblemError:
    """An upload read, checked and encoded (`parse_jsonl`, then `_encode`), or the problem
    to answer: returned, not raised, so that no exception carries this thread's frames
    (and the parsed lines with them) to the event loop. A large upload is read in a
    thread (`app.api.body.off_the_loop`, the path of large JSON bodies); what its lines
    were parsed into is freed in the background, a little at a time (`app.ingest.freeing`)."""
    trash: list[Any] = []
    try:
        return _prepare(raw, max_depth, trash)
    except InvalidInputError as problem:
        problem.__traceback__ = None  # its frames, and what they hold, go now
        return problem
    finally:
        # No frame that held the parsed lines is left: the disposer frees all of them.
        if len(raw) > INLINE_BYTES:
            dispose(trash)


def _prepare(raw: bytes, max_depth: int, trash: list[Any]) -> Prepared:
    splits = parse_jsonl(raw, max_depth=max_depth, trash=trash)
    document, payload = _encode(splits)
    return Prepared(
        sha256=hashlib.sha256(raw).hexdigest(),
        num_examples=sum(len(items) for items in splits.values()),
        splits={split: len(items) for split, items in splits.items()},
        payload=payload,
        payload_bytes=len(document),
    )


def parse_jsonl(
    raw: bytes, *, max_depth: int, trash: list[Any] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Every line checked; the examples by split, as stored. Raises InvalidInputError
    naming each bad line (at most MAX_ERRORS). Blank lines are skipped; a final line
    without a newline counts. Each line is parsed strictly (`app.ingest.jsontext`, a piece at a
    time) and validated alone, so no call holds the GIL for long; an example's `id` is
    unique in the upload. What is parsed goes to `trash` too (the caller frees it)."""
    errors: list[FieldError] = []
    splits: dict[str, list[dict[str, Any]]] = {}
    if trash is not None:
        trash.append(splits)
    seen: dict[str | int, int] = {}  # an id (as text) -> the line it is first on
    count = 0
    for number, line in enumerate(_lines(raw), start=1):
        if not line.strip():
            continue
        count += 1
        if count > MAX_EXAMPLES:
            errors.append(_error(number, (), f"more than {MAX_EXAMPLES} examples", "too_many"))
            break
        try:
            data = jsontext.loads(line.rstrip(b"\r"), max_depth=max_depth, max_errors=1)
            example = DatasetExample.model_validate(data)
        except jsontext.JsonTextError as exc:
            at = f" at character {exc.pos}" if exc.pos is not None else ""
            errors.append(_error(number, exc.path, exc.message + at, exc.type))
        except jsontext.JsonValueErrors as refused:
            first = refused.errors[0]
            errors.append(_error(number, first.path, first.message, first.type))
        except ValidationError as exc:
            for err in exc.errors(include_url=False)[:5]:
                errors.append(_error(number, err["loc"], err["msg"], err["type"]))
        else:
            key = str(example.id)
            first_on = seen.setdefault(key, number)
            if first_on != number:
                errors.append(
                    _error(
                        number,
                        ("id",),
                        f"the id {_shown(key)} is already the id of line {first_on}; "
                        "ids are unique in a dataset",
                        "duplicate_id",
                    )
                )
            else:
                stored = example.model_dump(mode="json", exclude={"split"})
                splits.setdefault(example.split, []).append(stored)
        if len(errors) >= MAX_ERRORS:
            break
    if not errors and count == 0:
        errors.append(FieldError(location="body", path="", message="no examples", type="missing"))
    if errors:
        more = " (the first are listed)" if len(errors) >= MAX_ERRORS else ""
        raise InvalidInputError(
            f"{len(errors)} invalid line(s) in the upload{more}; nothing was stored",
            errors=errors[:MAX_ERRORS],
        )
    return splits


def _shown(key: str) -> str:
    return repr(key) if len(key) <= 40 else repr(key[:40]) + "…"


def _lines(raw: bytes) -> Iterator[bytes]:
    """`raw.split(b"\n")` a line at a time: split whole, 50 MB is one call that holds the
    GIL (and so the event loop) while it copies every line."""
    start = 0
    while (end := raw.find(b"\n", start)) != -1:
        yield raw[start:end]
        start = end + 1
    yield raw[start:]


def _error(line: int, loc: Any, message: str, kind: str) -> FieldError:
    return FieldError(
        location="body", path=format_path(("line", line, *loc)), message=message, type=kind
    )


def new_dataset_id() -> str:
    return f"ds_{time.time_ns() // 1000:014x}{secrets.token_hex(5)}"


async def create_dataset(
    session: AsyncSession, *, name: str, prepared: Prepared, project_id: str = DEFAULT_PROJECT_ID
) -> tuple[Dataset, bool]:
    """Store a prepared upload in `project_id`; (dataset, created). The same name and bytes
    as a dataset of that project: that one, not created again."""
    await begin_write(session)
    existing = await session.scalar(
        select(DatasetRow).where(
            DatasetRow.name == name,
            DatasetRow.sha256 == prepared.sha256,
            DatasetRow.project_id == project_id,
        )
    )
    if existing is not None:
        return to_wire(existing), False
    row = DatasetRow(
        id=new_dataset_id(),
        name=name,
        sha256=prepared.sha256,
        num_examples=prepared.num_examples,
        splits=dict(prepared.splits),
        payload=prepared.payload,
        payload_bytes=prepared.payload_bytes,
        created_at=utcnow(),
        project_id=project_id,
    )
    session.add(row)
    await session.flush()
    return to_wire(row), True


def _encode(splits: dict[str, list[dict[str, Any]]]) -> tuple[bytes, bytes]:
    document = jsontext.dumps_bytes(splits)  # a piece at a time (see app.ingest.jsontext)
    return document, compress(document)


def to_wire(row: DatasetRow) -> Dataset:
    return Dataset(
        id=row.id,
        name=row.name,
        sha256=row.sha256,
        num_examples=row.num_examples,
        splits=dict(row.splits),
        created_at=row.created_at,
    )


async def get_dataset(
    session: AsyncSession, dataset_id: str, project_id: str | None = None
) -> DatasetRow:
    """The dataset; with `project_id`, only if it is that project's (else 404)."""
    row = await session.get(DatasetRow, dataset_id)
    if row is None or (project_id is not None and row.project_id != project_id):
        raise not_found("dataset", dataset_id, param="dataset_id")
    return row


async def list_datasets(
    session: AsyncSession,
    *,
    name: str | None,
    after: str | None,
    limit: int,
    project_id: str | None = None,
) -> tuple[list[Dataset], bool]:
    query = select(DatasetRow).order_by(DatasetRow.id.desc()).limit(limit + 1)
    if project_id is not None:
        query = query.where(DatasetRow.project_id == project_id)
    if name is not None:
        query = query.where(DatasetRow.name == name)
    if after:
        query = query.where(DatasetRow.id < after)
    rows = list((await session.scalars(query)).all())
    return [to_wire(r) for r in rows[:limit]], len(rows) > limit


async def delete_dataset(
    session: AsyncSession, dataset_id: str, project_id: str | None = None
) -> None:
    """409 while a run that has not ended reads it."""
    await begin_write(session)
    row = await get_dataset(session, dataset_id, project_id)
    active = await session.scalar(
        select(JobRow.id).where(
            JobRow.kind == "run",
            JobRow.status.in_(("queued", "running")),
            JobRow.summary["dataset"].as_string() == dataset_id,
        )
    )
    if active is not None:
        raise ConflictError(f"run {active} reads dataset {dataset_id}; it cannot be deleted")
    await session.delete(row)


# -- reading a dataset's splits (workers) -----------------------------------------------------

_cache: OrderedDict[str, dict[str, list[dict[str, Any]]]] = OrderedDict()
_CACHED = 8  # datasets kept decoded per process (a dataset never changes)


async def decode_splits(payload: bytes, size: int) -> dict[str, list[dict[str, Any]]]:
    """A stored dataset's examples by split; a large one decoded off the event loop."""

    def decode() -> dict[str, list[dict[str, Any]]]:
        splits: dict[str, list[dict[str, Any]]] = jsontext.load_stored(decompress(payload, size))
        return splits

    return await asyncio.to_thread(decode) if size > THREAD_BYTES else decode()


async def load_splits(conn: AsyncConnection, dataset_id: str) -> dict[str, list[dict[str, Any]]]:
    """A dataset's examples by split, decoded once per process."""
    if dataset_id in _cache:
        _cache.move_to_end(dataset_id)
        return _cache[dataset_id]
    row = (
        await conn.execute(
            select(DatasetRow.payload, DatasetRow.payload_bytes).where(DatasetRow.id == dataset_id)
        )
    ).one_or_none()
    if row is None:
        raise NotFoundError(f"dataset {dataset_id} is gone")

    splits = await decode_splits(row.payload, row.payload_bytes)
    _cache[dataset_id] = splits
    while len(_cache) > _CACHED:
        _cache.popitem(last=False)
    return splits
