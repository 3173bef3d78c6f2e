"""Request dependencies: a database session, the reader, and the parameters looked up in the
database. (The API key is checked before any route runs: `app.ingest.edge.ApiKeys`.)"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Header, Path, Query, Request
from pydantic import AfterValidator
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import Reader
from app.errors import ForbiddenError
from app.ingest.edge import principal_of
from app.jobs.usage import Pricing
from app.models import DEFAULT_PROJECT_ID
from app.schemas.common import NO_NUL
from app.tenants.keys import Principal

log = logging.getLogger(__name__)


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """One session per request; routes commit what they change, anything else rolls back."""
    session: AsyncSession = request.app.state.sessions()
    try:
        yield session
    finally:
        try:
            await asyncio.shield(session.close())
        except (SQLAlchemyError, OSError) as exc:
            # The database dropped the connection after the answer was ready (a restart):
            # what the route committed stands and the rest went with the connection. This
            # may run after the response has started: raising would cut it off half-way.
            log.warning("request session closed on a lost connection: %s", exc)
            with contextlib.suppress(Exception):
                await session.invalidate()


Session = Annotated[AsyncSession, Depends(get_session)]


async def get_reader(request: Request) -> Reader:
    # async: FastAPI runs a plain function's dependency in a thread, a trip per request.
    reader: Reader = request.app.state.reader
    return reader


Reads = Annotated[Reader, Depends(get_reader)]
"""For a route that only reads, and reads alone: one trip to the database (`app.db.Reader`)."""

# Identifiers and cursors are looked up in the database: no NUL characters (Postgres text
# cannot hold one, so no stored value has one).
JobId = Annotated[str, Path(pattern=NO_NUL)]
CURSOR = r"^([A-Za-z0-9][A-Za-z0-9._:@-]{0,255})?$"
"""Every `next_cursor` a page gives (an id, or a model's name) matches: one that does not
was not given by a page, and is refused (422) rather than answered with an empty page.
Empty (`?after=`, as a form or a command line's empty option sends it): the first page."""
Cursor = Annotated[
    str | None,
    Query(pattern=CURSOR, description="`next_cursor` of the previous page"),
    AfterValidator(lambda cursor: cursor or None),
]
ModelFilter = Annotated[str | None, Query(pattern=NO_NUL, description="Only jobs of this model.")]


IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        description="Retrying with the same key and body returns the original job.",
    ),
]


async def get_caller(request: Request) -> Principal:
    """The request's principal, as the edge found it (`app.ingest.edge.ApiKeys`)."""
    return principal_of(request.scope)


Caller = Annotated[Principal, Depends(get_caller)]
"""Who the request is: its key's id, project and scopes."""


def pricing(request: Request) -> Pricing:
    """The price table jobs and runs show their estimated cost by."""
    settings = request.app.state.settings
    return Pricing(settings.prices, settings.price_currency)


def scoped_key(caller: Principal, key: str | None) -> str | None:
    """An Idempotency-Key as stored: a project's own, so that another project's request
    with the same key neither replays this one's job nor learns it exists. The default
    project's (admin keys, keys of TRAINYARD_API_KEYS) are stored as sent, as before
    projects; another's as its id, a newline (which no header value holds, so the two
    cannot meet) and the key's SHA-256 (so it fits the column)."""
    if key is None or caller.owner == DEFAULT_PROJECT_ID:
        return key
    return f"{caller.owner}\n{hashlib.sha256(key.encode()).hexdigest()}"


def require_admin(caller: Principal) -> None:
    if not caller.admin:
        raise ForbiddenError("This key lacks the `admin` scope", missing_scope="admin")
