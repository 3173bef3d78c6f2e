"""Prometheus metrics: HTTP traffic (middleware), job and webhook delivery counts (read at
scrape time), each project's jobs and seconds (`ProjectCounters`: read from the job event
log at scrape time, from where the last scrape stopped), and serving saturation: each
admission's work per model (`where`: `gateway`, or the backend whose endpoint admits it)."""

from __future__ import annotations

import time
from collections import Counter as Counter_
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any, cast

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from sqlalchemy import BigInteger, Table, Text, case, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.requests import Request
from starlette.responses import Response

from app.backends.admission import Admission
from app.db import utcnow
from app.jobs import pools
from app.jobs.lifecycle import VOCABULARY, EventType, JobStatus
from app.jobs.usage import seconds_of
from app.models import JobEventRow, JobRow, WebhookDeliveryRow, WebhookEndpointRow
from app.tenants.usage import ROLLOUT_KINDS, TRAINER_KINDS

DELIVERY_STATUSES = ("pending", "succeeded", "failed")
job_events = cast(Table, JobEventRow.__table__)
jobs = cast(Table, JobRow.__table__)
ENDS = frozenset(
    {EventType.job_cancelled.value}
    | {word.value for words in VOCABULARY.values() for word in (words.ended, words.failed)}
)
"""The event that ends a job: it is written by the job's final write, once."""


class ProjectCounters:
    """Counters by project that only grow: jobs submitted (by kind), jobs finished (by kind
    and status), trainer and rollout seconds (as `GET /v1/usage` counts them: every attempt
    of a job, added when it ends). Read at scrape time from the job event
    log, past the last event the previous scrape read: a job's first event (its
    submission) and the event that ends it, joined to the job by its key. A scrape reads
    at most `BATCH` of them (what is left waits for the next) and never scans the jobs.

    They count from the process's first scrape (a counter's reset, to Prometheus). Every
    API replica reads the same log: aggregate replicas with `max`, not `sum`.

    On Postgres an event's id is taken when it is inserted, not when its transaction
    commits: an id below the last one seen can still appear. A scrape notes the highest
    id it sees and its snapshot's `xmax` (every transaction that could have inserted up to
    that id has an xid below it: an event is inserted after its transaction has written its
    job's row, the event counter, so the transaction holds its xid before the event takes
    its id). Once a later snapshot's `xmin` has passed that `xmax`, all those transactions
    have ended, and the events up to that id are read. No clock is trusted: a transaction
    held open anywhere in the cluster delays the counters, and none is lost. SQLite has
    one writer: ids come in commit order."""

    BATCH = 10_000
    PENDING = 64  # scrapes waiting for their transactions to end; past it, the last is replaced

    def __init__(self, registry: CollectorRegistry) -> None:
        self.submitted = Counter(
            "trainyard_project_jobs_submitted",
            "Jobs submitted, by project and kind",
            ["project", "kind"],
            registry=registry,
        )
        self.finished = Counter(
            "trainyard_project_jobs_finished",
            "Jobs that ended, by project, kind and final status",
            ["project", "kind", "status"],
            registry=registry,
        )
        self.trainer_seconds = Counter(
            "trainyard_project_trainer_seconds",
            "Trainer seconds of the training jobs that ended, by project (as GET /v1/usage)",
            ["project"],
            registry=registry,
        )
        self.rollout_seconds = Counter(
            "trainyard_project_rollout_seconds",
            "Rollout seconds of the rollout and evaluation jobs that ended, by project",
            ["project"],
            registry=registry,
        )
        self.cursor: int | None = None  # the last event read
        self.settled = 0  # every event up to this id is committed or never will be
        self.pending: list[tuple[int, int]] = []  # (xmax, highest id) of earlier scrapes

    async def read(self, session: AsyncSession) -> None:
        top, xmin, xmax = await self._snapshot(session)
        if len(self.pending) == self.PENDING:
            self.pending.pop()  # the newer scrape settles more, only later
        self.pending.append((xmax, top))
        if self.cursor is None:  # the first scrape: count from here on
            self.cursor = self.settled = top
            return
        # The scrapes whose transactions have all ended since (this one too, if none was open).
        while self.pending and self.pending[0][0] <= xmin:
            self.settled = max(self.settled, self.pending.pop(0)[1])
        if self.settled <= self.cursor:
            return
        rows = (
            await session.execute(
                select(
                    job_events.c.id,
                    job_events.c.seq,
                    job_events.c.type,
                    jobs.c.project_id,
                    jobs.c.kind,
                    jobs.c.status,
                    jobs.c.started_at,
                    jobs.c.finished_at,
                    jobs.c.attempts,
                    jobs.c.returned_at_attempt,
                    jobs.c.earlier_seconds,
                )
                .join(jobs, jobs.c.id == job_events.c.job_id)
                .where(
                    job_events.c.id > self.cursor,
                    job_events.c.id <= self.settled,
                    or_(job_events.c.seq == 1, job_events.c.type.in_(ENDS)),
                )
                .order_by(job_events.c.id)
                .limit(self.BATCH)
            )
        ).all()
        self._count(rows)
        # Past the events read and those between them that count nothing.
        self.cursor = rows[-1].id if len(rows) == self.BATCH else self.settled

    @staticmethod
    async def _snapshot(session: AsyncSession) -> tuple[int, int, int]:
        """The highest event id visible now, and the xmin and xmax of the snapshot it was
        read in. SQLite has no transaction open beside a reader's: (0, 0), settled at once."""
        top = select(func.max(job_events.c.id)).scalar_subquery()
        if session.get_bind().dialect.name != "postgresql":
            return await session.scalar(select(top)) or 0, 0, 0
        snapshot = func.pg_current_snapshot()
        xids = [  # xid8 has no int cast
            func.pg_snapshot_xmin(snapshot).cast(Text).cast(BigInteger),
            func.pg_snapshot_xmax(snapshot).cast(Text).cast(BigInteger),
        ]
        row = (await session.execute(select(top, *xids))).one()  # one statement: one snapshot
        return row[0] or 0, int(row[1]), int(row[2])

    def _count(self, rows: Any) -> None:
        """Summed per label set first: a counter's `inc` costs more than the row's read."""
        submitted: Counter_[tuple[str, str]] = Counter_()
        finished: Counter_[tuple[str, str, str]] = Counter_()
        seconds: dict[str, defaultdict[str, float]] = {
            "trainer": defaultdict(float),
            "rollout": defaultdict(float),
        }
        for row in rows:
            if row.seq == 1:
                submitted[row.project_id, row.kind] += 1
            if row.type not in ENDS:
                continue
            finished[row.project_id, row.kind, row.status] += 1
            if row.started_at is not None and row.finished_at is not None:
                took = seconds_of(row) or 0.0  # every attempt's, as GET /v1/usage
                if row.kind in TRAINER_KINDS:
                    seconds["trainer"][row.project_id] += took
                elif row.kind in ROLLOUT_KINDS:
                    seconds["rollout"][row.project_id] += took
        for labels, n in submitted.items():
            self.submitted.labels(*labels).inc(n)
        for ended, n in finished.items():
            self.finished.labels(*ended).inc(n)
        for project, took in seconds["trainer"].items():
            self.trainer_seconds.labels(project).inc(took)
        for project, took in seconds["rollout"].items():
            self.rollout_seconds.labels(project).inc(took)


class Metrics:
    """One registry per app, so several apps (tests) never share counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "trainyard_http_requests_total",
            "HTTP requests",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "trainyard_http_request_duration_seconds",
            "HTTP request latency",
            ["method", "route"],
            registry=self.registry,
        )
        self.jobs = Gauge(
            "trainyard_jobs", "Jobs by status", ["kind", "status"], registry=self.registry
        )
        self.webhook_deliveries = Gauge(
            "trainyard_webhook_deliveries",
            "Webhook deliveries by status (pending: not yet delivered, retries left)",
            ["status"],
            registry=self.registry,
        )
        self.webhook_breakers = Gauge(
            "trainyard_webhook_endpoints",
            "Webhook endpoints by circuit breaker state (open: held back, its last attempts "
            "timed out; half_open: tried one delivery at a time)",
            ["breaker"],
            registry=self.registry,
        )
        self.webhook_in_flight = Gauge(
            "trainyard_webhook_in_flight",
            "Webhook deliveries being sent now (leased by a worker)",
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "trainyard_queue_depth",
            "Queued jobs that are eligible to run now",
            registry=self.registry,
        )
        serving = ["where", "model", "state"]
        self.serving_tokens = Gauge(
            "trainyard_serving_tokens",
            "Admitted chat work per model, in tokens (n x max_tokens): in_flight or queued",
            serving,
            registry=self.registry,
        )
        self.serving_requests = Gauge(
            "trainyard_serving_requests",
            "Admitted chat requests per model: in_flight or queued (the serving queue depth)",
            serving,
            registry=self.registry,
        )
        self.serving_oldest_wait = Gauge(
            "trainyard_serving_oldest_wait_seconds",
            "How long the oldest queued chat request of a model has waited",
            ["where", "model"],
            registry=self.registry,
        )
        self.serving_waited = Gauge(
            "trainyard_serving_waited_seconds",
            "Total queued time of the chat requests that started, since the process started",
            ["where", "model"],
            registry=self.registry,
        )
        self.serving_started = Gauge(
            "trainyard_serving_started",
            "Chat requests that started, since the process started",
            ["where", "model"],
            registry=self.registry,
        )
        self.serving_refused = Gauge(
            "trainyard_serving_refused",
            "Chat requests refused with 429 (the model was saturated), since the process started",
            ["where", "model"],
            registry=self.registry,
        )
        self.serving_abandoned = Gauge(
            "trainyard_serving_abandoned",
            "Chat requests stopped unfinished because their client went away, since the "
            "process started",
            ["where", "model"],
            registry=self.registry,
        )
        self.serving_bound = Gauge(
            "trainyard_serving_max_tokens",
            "The bound on admitted work per model, in tokens",
            ["where"],
            registry=self.registry,
        )

        self.pool_queue_depth = Gauge(
            "trainyard_pool_queue_depth",
            "Queued jobs due now, by the pool and backend of their model (what a pool's "
            "autoscaler scales on)",
            ["pool", "backend"],
            registry=self.registry,
        )
        self.projects = ProjectCounters(self.registry)
        self.live_workers = Gauge(
            "trainyard_live_workers",
            "Live workers that claim (heartbeating within the lease time, not draining), by "
            "pool and by backend they run",
            ["pool", "backend"],
            registry=self.registry,
        )

    async def middleware(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        start = time.perf_counter()
        status = 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            route = _route_template(request)
            self.requests.labels(request.method, route, str(status)).inc()
            self.latency.labels(request.method, route).observe(time.perf_counter() - start)

    def serving(self, admissions: dict[str, Admission]) -> None:
        for where, admission in admissions.items():
            self.serving_bound.labels(where).set(admission.max_tokens)
            totals = admission.totals()
            for model, load in admission.load().items():
                for state, tokens, requests in (
                    ("in_flight", load.in_flight_tokens, load.in_flight_requests),
                    ("queued", load.queued_tokens, load.queued_requests),
                ):
                    self.serving_tokens.labels(where, model, state).set(tokens)
                    self.serving_requests.labels(where, model, state).set(requests)
                self.serving_oldest_wait.labels(where, model).set(load.oldest_wait_s)
                refused, started, waited, abandoned = totals.get(model, (0, 0, 0.0, 0))
                self.serving_refused.labels(where, model).set(refused)
                self.serving_started.labels(where, model).set(started)
                self.serving_waited.labels(where, model).set(waited)
                self.serving_abandoned.labels(where, model).set(abandoned)

    async def render(
        self,
        sessions: async_sessionmaker[AsyncSession],
        admissions: dict[str, Admission] | None = None,
        *,
        lease_seconds: float = 30.0,
    ) -> tuple[bytes, str]:
        self.serving(admissions or {})
        async with sessions() as session:
            await self.projects.read(session)
            by_pool = await pools.queue_by_pool(session)
            live = pools.workers_by_pool(
                await pools.live_workers(session, lease_seconds=lease_seconds)
            )
            counts = (
                await session.execute(
                    select(JobRow.kind, JobRow.status, func.count()).group_by(
                        JobRow.kind, JobRow.status
                    )
                )
            ).all()
            depth = await session.scalar(
                select(func.count()).where(
                    JobRow.status == JobStatus.queued.value, JobRow.not_before <= utcnow()
                )
            )
            by_status = select(WebhookDeliveryRow.status, func.count()).group_by(
                WebhookDeliveryRow.status
            )
            deliveries = {status: n for status, n in (await session.execute(by_status)).all()}
            now = utcnow()
            breaker = case(
                (WebhookEndpointRow.breaker_open_until.is_(None), "closed"),
                (WebhookEndpointRow.breaker_open_until > now, "open"),
                else_="half_open",
            )
            by_breaker = select(breaker, func.count()).group_by(breaker)
            breakers = {state: n for state, n in (await session.execute(by_breaker)).all()}
            in_flight = await session.scalar(
                select(func.count()).where(
                    WebhookDeliveryRow.status == "pending",
                    WebhookDeliveryRow.lease_token.is_not(None),
                    WebhookDeliveryRow.next_attempt_at > now,
                )
            )
        for state in ("closed", "open", "half_open"):
            self.webhook_breakers.labels(state).set(breakers.get(state, 0))
        self.webhook_in_flight.set(in_flight or 0)
        for delivery_status in DELIVERY_STATUSES:
            self.webhook_deliveries.labels(delivery_status).set(deliveries.get(delivery_status, 0))
        seen = {(kind, status): n for kind, status, n in counts}
        for kind in {k for k, _ in seen} | {"training"}:
            for status in JobStatus:
                self.jobs.labels(kind, status.value).set(seen.get((kind, status.value), 0))
        self.queue_depth.set(depth or 0)
        # Pools come and go: a pool no job or worker is in any more drops out.
        self.pool_queue_depth.clear()
        for (pool, backend), count in by_pool.items():
            self.pool_queue_depth.labels(pool, backend).set(count)
        self.live_workers.clear()
        for (pool, backend), count in live.items():
            self.live_workers.labels(pool, backend).set(count)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _route_template(request: Request) -> str:
    # Label by route template, not raw path, so job ids do not explode the label set.
    return getattr(request.scope.get("route"), "path", "unmatched")
