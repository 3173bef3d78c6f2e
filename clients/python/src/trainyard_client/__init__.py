"""Trainyard's Python SDK: `Trainyard` (sync) and `AsyncTrainyard` (async) clients for its
HTTP API, with retries, idempotent submits, typed problem errors and event streams."""

from trainyard_client._async import AsyncTrainyard
from trainyard_client._retry import RetryPolicy
from trainyard_client._sync import Trainyard
from trainyard_client._version import __version__
from trainyard_client.errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitedError,
    ServerError,
    ServiceUnavailableError,
    TrainyardConnectionError,
    TrainyardError,
    ValidationError,
    WaitTimeoutError,
)
from trainyard_client.models import (
    EventType,
    JobEvent,
    JobStatus,
    Model,
    Page,
    Problem,
    RolloutJob,
    TrainingJob,
)
from trainyard_client.progress import Progress

__all__ = [
    "APIError",
    "AsyncTrainyard",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "EventType",
    "JobEvent",
    "JobStatus",
    "Model",
    "NotFoundError",
    "Page",
    "PayloadTooLargeError",
    "Problem",
    "Progress",
    "RateLimitedError",
    "RetryPolicy",
    "RolloutJob",
    "ServerError",
    "ServiceUnavailableError",
    "TrainingJob",
    "Trainyard",
    "TrainyardConnectionError",
    "TrainyardError",
    "ValidationError",
    "WaitTimeoutError",
    "__version__",
]
