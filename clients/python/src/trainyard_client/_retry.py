"""When to send a request again, and after how long: the rules both clients share."""

from __future__ import annotations

import email.utils
import logging
import random
import time
from dataclasses import dataclass

import httpx

from trainyard_client._calls import Call

log = logging.getLogger("trainyard_client")

# Failures after which the request cannot have reached the server.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Statuses that say the server did nothing (429: too many requests; 503: a dependency is
# away, nothing was written): retried whatever the request.
REFUSED = frozenset({429, 503})
# Statuses after which the request may or may not have had its effect.
MAYBE_DONE = frozenset({500, 502, 504})


@dataclass
class Attempts:
    """How the sends of one call went."""

    count: int = 0
    doubtful: bool = False
    """Whether a copy that failed may have had its effect (its connection broke after it
    was sent, or it got a 500/502/504): a later answer may be about that effect."""


@dataclass(frozen=True)
class RetryPolicy:
    """Retries with exponential backoff and full jitter, honouring `Retry-After`.

    Attempt n (from 1) that fails waits a random time in [0, min(max_delay, base_delay *
    2**(n-1))], or what the server's `Retry-After` asks (capped at `max_retry_after`), then
    sends the same request again, up to `max_retries` times.
    """

    max_retries: int = 5
    base_delay: float = 0.5
    max_delay: float = 30.0
    max_retry_after: float = 120.0

    def backoff(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))

    def after_error(self, call: Call[object], exc: Exception, sent: Attempts) -> float | None:
        """Seconds to wait before resending after a transport error, or None to give up."""
        if not isinstance(exc, NOT_SENT):
            sent.doubtful = True
            if not call.resend:
                return None
        if sent.count > self.max_retries:
            return None
        delay = self.backoff(sent.count)
        log.info("%s: %s; retrying in %.2f s", call.operation, type(exc).__name__, delay)
        return delay

    def after_response(
        self, call: Call[object], response: httpx.Response, sent: Attempts
    ) -> float | None:
        """Seconds to wait before resending after this answer, or None to keep it."""
        status = response.status_code
        if status in call.accept:
            return None
        # A resent submit can meet its own first copy still being written: a 409 "a
        # request with this Idempotency-Key is in progress". Asked again shortly, it is
        # answered with the job.
        in_progress = status == 409 and sent.doubtful and call.idempotency_key is not None
        retry = status in REFUSED or (status in MAYBE_DONE and call.resend) or in_progress
        if status in MAYBE_DONE:
            sent.doubtful = True
        if not retry or sent.count > self.max_retries:
            return None
        delay = self.backoff(sent.count)
        asked = retry_after(response)
        if asked is not None and asked > self.max_retry_after:
            return None  # longer than this client waits (a project's daily budget): raise
        if asked is not None:
            # At least what the server asks, plus a little jitter so clients told the same
            # second do not all come back in it.
            delay = min(asked, self.max_retry_after) + random.uniform(0, 0.1 * asked + 0.05)
        log.info("%s: HTTP %d; retrying in %.2f s", call.operation, status, delay)
        return delay


def retry_after(response: httpx.Response) -> float | None:
    """`Retry-After` in seconds: delay-seconds or an HTTP date."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
