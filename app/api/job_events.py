"""A job's event log, paged and as a Server-Sent-Events stream: the same two routes on
every kind of job (`add_event_routes`).

No `from __future__ import annotations` here: FastAPI must resolve the route signatures,
which refer to a dependency defined inside `add_event_routes`.
"""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from fastapi.sse import KEEPALIVE_COMMENT, format_sse_event
from pydantic import WithJsonSchema
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.api.deps import Caller, JobId, Session
from app.jobs import events as event_service
from app.jobs.lifecycle import JobKind, JobStatus
from app.jobs.service import get_job
from app.models import JobRow
from app.schemas.common import Page, problem_responses
from app.schemas.jobs import JobEvent

MAX_SEQ = 2**31 - 1  # event seqs are 32-bit integers in the database
STREAM_SECONDS = 300.0  # a stream ends after this; EventSource clients resume by Last-Event-ID
POLL_SECONDS = 2.0  # fallback when no wake-up arrives (another process, no LISTEN)
PING_SECONDS = 15.0  # a comment on an idle stream, so proxies do not close it


class EventStream(StreamingResponse):
    """A `text/event-stream` response of SSE-formatted bytes.

    Not FastAPI's `EventSourceResponse`: a route with that response class has FastAPI relay
    the events it yields through a task that fails, and logs an unhandled error, when the
    client leaves while events are still buffered (FastAPI 0.165). Starlette's streaming
    response stops cleanly.
    """

    media_type = "text/event-stream"


# The stream's events (OpenAPI 3.2 `itemSchema`): `data` is a JobEvent as JSON.
SSE_RESPONSE = {
    "description": "The job's events after the cursor, one SSE event each, until the job "
    f"ends; a `: ping` comment every {PING_SECONDS:g} s while nothing happens.",
    "content": {
        "text/event-stream": {
            "itemSchema": {
                "type": "object",
                "properties": {
                    "data": {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"$ref": "#/components/schemas/JobEvent"},
                    },
                    "event": {"type": "string", "description": "The event's `type`."},
                    "id": {"type": "string", "description": "The event's `seq`."},
                    "retry": {"type": "integer", "minimum": 0},
                },
                "required": ["data", "event", "id"],
            }
        }
    },
}


def add_event_routes(router: APIRouter, kind: JobKind) -> None:
    @router.get(
        "/{job_id}/events",
        response_model=Page[JobEvent],
        summary="List a job's events",
        responses=problem_responses(404, 422),
    )
    async def events(
        job_id: JobId,
        session: Session,
        caller: Caller,
        after: Annotated[
            int, Query(ge=0, le=MAX_SEQ, description="Return events with seq > after.")
        ] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> Page[JobEvent]:
        await get_job(session, job_id, kind=kind, param="job_id", project_id=caller.sees)
        items, has_more = await event_service.list_events(session, job_id, after=after, limit=limit)
        return Page(
            data=items,
            has_more=has_more,
            next_cursor=str(items[-1].seq) if has_more and items else None,
        )

    async def stream_cursor(
        job_id: JobId,
        request: Request,
        caller: Caller,
        last_event_id: Annotated[
            int | None,
            # A header is sent or not, never JSON null: without this the schema offers a
            # `null` branch, which a client can only send as the text "null" (422).
            WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_SEQ}),
            Header(
                alias="Last-Event-ID",
                ge=0,
                le=MAX_SEQ,
                description="Seq of the last event received (an EventSource sends it when it "
                "reconnects): the stream resumes after it. Wins over `after`.",
            ),
        ] = None,
        after: Annotated[
            int | None, Query(ge=0, le=MAX_SEQ, description="Start after this seq.")
        ] = None,
    ) -> int:
        # Runs before the stream starts, so a bad job id is still a plain 404. Its own short
        # session: a request-scoped one would stay open for the whole stream.
        async with request.app.state.sessions() as session:
            await get_job(session, job_id, kind=kind, param="job_id", project_id=caller.sees)
        # A reconnecting EventSource repeats its URL (with any ?after=) and sends the
        # header, which is the newer of the two.
        if last_event_id is not None:
            return last_event_id
        return after or 0

    @router.get(
        "/{job_id}/events/stream",
        # Documented by SSE_RESPONSE alone: a response class with a media type would add a
        # `schema` (the whole body as one string) beside its `itemSchema`.
        response_class=Response,
        summary="Stream a job's events (Server-Sent Events); resumes after Last-Event-ID",
        responses={200: SSE_RESPONSE, **problem_responses(404, 422)},
    )
    async def stream(
        job_id: JobId, request: Request, cursor: Annotated[int, Depends(stream_cursor)]
    ) -> EventStream:
        return EventStream(
            _events(request, job_id, cursor, kind),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


async def _poll(
    sessions: async_sessionmaker[AsyncSession], job_id: str, cursor: int, kind: JobKind
) -> tuple[list[JobEvent], JobRow]:
    # A short session per poll: nothing stays open while the stream waits.
    async with sessions() as session:
        items, _ = await event_service.list_events(session, job_id, after=cursor, limit=500)
        return items, await get_job(session, job_id, kind=kind, param="job_id")


async def _events(
    request: Request, job_id: str, cursor: int, kind: JobKind
) -> AsyncIterator[bytes]:
    """The job's events after `cursor` in SSE wire format, until the job ends (or
    STREAM_SECONDS pass); a comment every PING_SECONDS while nothing happens."""
    sessions = request.app.state.sessions
    loop = asyncio.get_running_loop()
    ends_at = loop.time() + STREAM_SECONDS
    sent_at = loop.time()
    with request.app.state.notifier.watch_events(job_id) as changed:
        while True:
            changed.clear()
            # Shielded: a client that leaves cancels the stream, and a database session
            # cancelled mid-query does not close its connection cleanly.
            items, job = await asyncio.shield(_poll(sessions, job_id, cursor, kind))
            for item in items:
                cursor = item.seq
                # JSON as FastAPI wrote event data: `json.dumps` spacing, NaN as null.
                data = json.dumps(json.loads(item.model_dump_json()))
                yield format_sse_event(data_str=data, event=item.type, id=str(item.seq))
            if items:
                sent_at = loop.time()
            if JobStatus(job.status).is_final and cursor >= job.last_event_seq:
                return
            if loop.time() >= ends_at:
                return  # the client resumes from its Last-Event-ID
            if loop.time() - sent_at >= PING_SECONDS:
                yield KEEPALIVE_COMMENT  # so proxies keep an idle stream open
                sent_at = loop.time()
            if not items:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), POLL_SECONDS)
