"""The gateway's usage rows: one per answered chat completion whose tokens are known,
attributed to the calling key and its project, queued after the answer and written in
batches by a background task (`app.tenants.audit.BatchWriter`): a call never waits on it.

Tokens are read from the answer's `usage` without parsing the whole answer (it can hold
logprobs for every token): the last `"usage"` object's two counts, found by a search from
its end. A streamed answer has them in its last chunk when the client asked for them
(`stream_options: {"include_usage": true}`); without them it is not counted.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, cast

from sqlalchemy import Table

from app.db import utcnow
from app.models import GatewayUsageRow
from app.tenants.audit import BatchWriter

gateway_usage = cast(Table, GatewayUsageRow.__table__)
_COUNT = {
    name: re.compile(rb'"' + name + rb'_tokens"\s*:\s*(\d+)') for name in (b"prompt", b"completion")
}
TAIL_CHUNKS = 4
"""A stream's last chunks searched for its usage (the usage chunk, `[DONE]`, and what a
chunk boundary may have split)."""


class GatewayMeter(BatchWriter):
    table = gateway_usage
    name = "gateway-usage"

    async def record(
        self, *, project_id: str, key_id: str | None, model: str, tokens: tuple[int, int]
    ) -> None:
        await self.put(
            {
                "created_at": utcnow(),
                "project_id": project_id,
                "key_id": key_id,
                "model": model,
                "prompt_tokens": tokens[0],
                "completion_tokens": tokens[1],
            }
        )


def tokens_in(content: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens of the last `"usage"` object in `content`, or None."""
    at = content.rfind(b'"usage"')
    if at < 0:
        return None
    counts = []
    for name in (b"prompt", b"completion"):
        found = _COUNT[name].search(content, at)
        if found is None:
            return None
        counts.append(int(found.group(1)))
    return counts[0], counts[1]


async def metered(
    chunks: AsyncIterable[Any], counted: Callable[[tuple[int, int]], Awaitable[None]]
) -> AsyncIterator[Any]:
    """A streamed answer relayed as it arrives; once it ends, its usage (if it says) is
    `counted`."""
    tail: deque[bytes] = deque(maxlen=TAIL_CHUNKS)
    async for chunk in chunks:
        yield chunk
        tail.append(chunk.encode() if isinstance(chunk, str) else bytes(chunk))
    tokens = tokens_in(b"".join(tail))
    if tokens is not None:
        await counted(tokens)
