"""Prometheus metrics: HTTP traffic (middleware), job and webhook delivery counts (read at
scrape time), and serving saturation: each admission's work per model (`where`: `gateway`,
or the backend whose endpoint admits it)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.requests import Request
from starlette.responses import Response

from app.backends.admission import Admission
from app.db import utcnow
from app.jobs import pools
from app.jobs.lifecycle import JobStatus
from app.models import JobRow, WebhookDeliveryRow, WebhookEndpointRow

DELIVERY_STATUSES = ("pending", "succeeded", "failed")


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
