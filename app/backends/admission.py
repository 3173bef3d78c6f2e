"""Admission control in front of a model's serving: a bounded amount of work per model,
counted in tokens (`n x max_tokens`), in flight and queued together.

A request is admitted while its model's admitted tokens plus its own stay within the bound
(a model with nothing admitted takes any one request, so no request is refused forever);
past it the caller answers 429 with `Retry-After`. Admitted work is `queued` until it
starts (`Ticket.start`) and `in flight` until it ends (`Ticket.release`); what is queued,
and for how long, is what `/metrics` and `/readyz` show as saturation.

Thread-safe: the cpu backend's endpoint admits on its own thread, and the API reads the
figures on its own.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

DEFAULT_MAX_TOKENS = 131_072
DEFAULT_RETRY_AFTER_S = 1


@dataclass
class Load:
    """One model's admitted work now."""

    in_flight_tokens: int = 0
    queued_tokens: int = 0
    queued_requests: int = 0
    in_flight_requests: int = 0
    oldest_wait_s: float = 0.0


@dataclass
class _Model:
    tickets: dict[int, Ticket] = field(default_factory=dict)
    refused: int = 0
    abandoned: int = 0
    waited_s: float = 0.0  # total queued time of the requests that started
    started: int = 0


class Ticket:
    """One admitted request; `release` it when done (idempotent)."""

    def __init__(self, admission: Admission, model: str, key: int, tokens: int) -> None:
        self._admission, self.model, self._key, self.tokens = admission, model, key, tokens
        self.admitted_at = time.monotonic()
        self.started_at: float | None = None

    def start(self) -> None:
        self._admission._start(self)

    def release(self) -> None:
        self._admission._release(self)

    def abandon(self) -> None:
        """Its caller went away and the work stopped unfinished (counted, then released)."""
        self._admission._release(self, abandoned=True)


class Refused(Exception):
    """Past the bound: try again after `retry_after` seconds."""

    def __init__(self, model: str, tokens: int, admitted: int, bound: int, retry_after: int):
        super().__init__(
            f"The model `{model}` is saturated: {admitted} tokens of work are admitted and "
            f"this request asks for {tokens} more (n x max_tokens), over the bound of {bound}; "
            f"try again in {retry_after} s."
        )
        self.retry_after = retry_after


class Admission:
    def __init__(
        self, max_tokens: int = DEFAULT_MAX_TOKENS, retry_after: int = DEFAULT_RETRY_AFTER_S
    ) -> None:
        if max_tokens < 1 or retry_after < 1:
            raise ValueError("max_tokens and retry_after must be at least 1")
        self.max_tokens, self.retry_after = max_tokens, retry_after
        self._lock = threading.Lock()
        self._models: dict[str, _Model] = {}
        self._keys = itertools.count()

    def admit(self, model: str, tokens: int) -> Ticket:
        """A ticket for `tokens` of work on `model`, or `Refused`."""
        with self._lock:
            state = self._models.setdefault(model, _Model())
            admitted = sum(t.tokens for t in state.tickets.values())
            if state.tickets and admitted + tokens > self.max_tokens:
                state.refused += 1
                raise Refused(model, tokens, admitted, self.max_tokens, self.retry_after)
            ticket = Ticket(self, model, next(self._keys), tokens)
            state.tickets[ticket._key] = ticket
            return ticket

    def _start(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.started_at is None:
                ticket.started_at = time.monotonic()
                state = self._models[ticket.model]
                state.started += 1
                state.waited_s += ticket.started_at - ticket.admitted_at

    def _release(self, ticket: Ticket, *, abandoned: bool = False) -> None:
        with self._lock:
            state = self._models[ticket.model]
            if state.tickets.pop(ticket._key, None) is not None and abandoned:
                state.abandoned += 1

    def load(self) -> dict[str, Load]:
        """Every model's admitted work now (models seen before and idle: zeros)."""
        now = time.monotonic()
        with self._lock:
            loads = {}
            for model, state in self._models.items():
                load = Load()
                for ticket in state.tickets.values():
                    if ticket.started_at is None:
                        load.queued_tokens += ticket.tokens
                        load.queued_requests += 1
                        load.oldest_wait_s = max(load.oldest_wait_s, now - ticket.admitted_at)
                    else:
                        load.in_flight_tokens += ticket.tokens
                        load.in_flight_requests += 1
                loads[model] = load
            return loads

    def totals(self) -> dict[str, tuple[int, int, float, int]]:
        """Per model: (requests refused, requests started, their total queued seconds,
        requests abandoned unfinished)."""
        with self._lock:
            return {
                m: (s.refused, s.started, s.waited_s, s.abandoned) for m, s in self._models.items()
            }

    def saturated(self) -> list[str]:
        """Models whose admitted work is at the bound: new work would be refused."""
        return sorted(
            model
            for model, load in self.load().items()
            if load.in_flight_tokens + load.queued_tokens >= self.max_tokens
        )


class Abandoned(Exception):
    """The work's caller went away (or its job was cancelled): it stopped unfinished."""
