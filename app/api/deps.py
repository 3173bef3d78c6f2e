"""Request dependencies: a database session and the API-key check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Path, Query, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import Reader
from app.edge import UNAUTHORIZED_DETAIL, key_matches
from app.schemas.common import NO_NUL

log = logging.getLogger(__name__)

bearer = HTTPBearer(auto_error=False, description="A key from TRAINYARD_API_KEYS.")


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


async def require_api_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
) -> None:
    """Documents the bearer scheme on every protected operation, and checks the key again.
    The check that counts runs earlier, in `app.edge.ApiKeys`, before the body is read."""
    keys = request.app.state.settings.api_keys
    if keys and not key_matches(keys, credentials.credentials if credentials else None):
        raise HTTPException(
            status_code=401, detail=UNAUTHORIZED_DETAIL, headers={"WWW-Authenticate": "Bearer"}
        )


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
Cursor = Annotated[
    str | None, Query(pattern=NO_NUL, description="`next_cursor` of the previous page")
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
