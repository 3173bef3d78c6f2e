"""Request dependencies: a database session and the API-key check."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession

bearer = HTTPBearer(auto_error=False, description="A key from TRAINYARD_API_KEYS.")


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """One session per request; routes commit what they change, anything else rolls back."""
    async with request.app.state.sessions() as session:
        yield session


async def require_api_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
) -> None:
    keys = request.app.state.settings.api_keys
    if not keys:
        return
    given = credentials.credentials.encode() if credentials else b""
    matched = False
    for key in keys:  # compare with every key, so timing says nothing about which matched
        matched |= hmac.compare_digest(given, key.get_secret_value().encode())
    if not matched:
        raise HTTPException(
            status_code=401,
            detail="Missing or invalid API key: send `Authorization: Bearer <key>`",
            headers={"WWW-Authenticate": "Bearer"},
        )


Session = Annotated[AsyncSession, Depends(get_session)]
