"""A job's event log, paged and as a Server-Sent-Events stream: the same two routes on
every kind of job (`add_event_routes`).

No `from __future__ import annotations` here: FastAPI must resolve the route signatures,
which refer to a dependency defined inside `add_event_routes`.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent

from app.api.deps import Session
from app.errors import InvalidInputError, field_errors
from app.models import JobKind, JobStatus
from app.schemas.common import Page, problem_responses
from app.schemas.jobs import JobEvent
from app.services import events as event_service
from app.services.jobs import get_job

MAX_SEQ = 2**31 - 1  # event seqs are 32-bit integers in the database
STREAM_SECONDS = 300.0  # a stream ends after this; EventSource clients resume by Last-Event-ID
POLL_SECONDS = 2.0  # fallback when no wake-up arrives (another process, no LISTEN)


def _last_event_id(value: str | None) -> int:
    if value is None or value == "":
        return 0
    if not (value.isascii() and value.isdigit() and len(value) <= 10 and int(value) <= MAX_SEQ):
        raise InvalidInputError(
            "Last-Event-ID must be an event seq",
            errors=field_errors(
                [
                    {
                        "loc": ("header", "last-event-id"),
                        "msg": "not an integer",
                        "type": "int_parsing",
                    }
                ]
            ),
        )
    return int(value)


def add_event_routes(router: APIRouter, kind: JobKind) -> None:
    @router.get(
        "/{job_id}/events",
        response_model=Page[JobEvent],
        summary="List a job's events",
        responses=problem_responses(404, 422),
    )
    async def events(
        job_id: str,
        session: Session,
        after: Annotated[
            int, Query(ge=0, le=MAX_SEQ, description="Return events with seq > after.")
        ] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> Page[JobEvent]:
        await get_job(session, job_id, kind=kind)
        items, has_more = await event_service.list_events(session, job_id, after=after, limit=limit)
        return Page(
            data=items,
            has_more=has_more,
            next_cursor=str(items[-1].seq) if has_more and items else None,
        )

    async def stream_cursor(
        job_id: str,
        request: Request,
        last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
        after: Annotated[
            int | None, Query(ge=0, le=MAX_SEQ, description="Start after this seq.")
        ] = None,
    ) -> int:
        # Runs before the stream starts, so a bad job id is still a plain 404. Its own short
        # session: a request-scoped one would stay open for the whole stream.
        async with request.app.state.sessions() as session:
            await get_job(session, job_id, kind=kind)
        # A reconnecting EventSource repeats its URL (with any ?after=) and sends the
        # header, which is the newer of the two.
        if last_event_id is not None:
            return _last_event_id(last_event_id)
        return after or 0

    @router.get(
        "/{job_id}/events/stream",
        response_class=EventSourceResponse,
        summary="Stream a job's events (Server-Sent Events); resumes after Last-Event-ID",
        responses=problem_responses(404, 422),
    )
    async def stream(
        job_id: str, request: Request, cursor: Annotated[int, Depends(stream_cursor)]
    ) -> AsyncIterator[ServerSentEvent]:
        sessions = request.app.state.sessions
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + STREAM_SECONDS
        with request.app.state.notifier.watch_events(job_id) as changed:
            while True:
                changed.clear()
                # A short session per poll: nothing stays open while the stream waits.
                async with sessions() as session:
                    items, _ = await event_service.list_events(
                        session, job_id, after=cursor, limit=500
                    )
                    job = await get_job(session, job_id, kind=kind)
                for item in items:
                    cursor = item.seq
                    yield ServerSentEvent(
                        id=str(item.seq), event=item.type, data=item.model_dump(mode="json")
                    )
                if JobStatus(job.status).is_final and cursor >= job.last_event_seq:
                    return
                if loop.time() >= ends_at:
                    return  # the client resumes from its Last-Event-ID
                if not items:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), POLL_SECONDS)
