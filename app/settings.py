"""Service configuration: one settings class, every field from a `TRAINYARD_` variable."""

from __future__ import annotations

import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.egress import Rule

DEFAULT_DATA_DIR = Path("var")
DEFAULT_POOL = "default"
POOL_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?$"
"""A pool name: a DNS label (it names Kubernetes objects too), at most 64 characters."""
LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?$")
MAX_LABELS = 32


def label_refusal(key: str, value: str) -> str | None:
    """Why `key=value` is not a label (None: it is one). Keys and values as Kubernetes
    labels: letters, digits, `.`, `_`, `-` (and `/` in a key), alphanumeric at both ends, at
    most 64 and 63 characters; a value may be empty."""
    if not LABEL_KEY.match(key):
        return (
            f"label key {key!r}: 1 to 64 letters, digits, '.', '_', '-', '/', "
            "alphanumeric at both ends"
        )
    if not LABEL_VALUE.match(value):
        return (
            f"label {key!r}: value {value!r}: up to 63 letters, digits, '.', '_', '-', "
            "alphanumeric at both ends"
        )
    return None


def parse_labels(text: str) -> dict[str, str]:
    """`k=v,k=v` as {k: v}; ValueError naming the bad entry."""
    labels: dict[str, str] = {}
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise ValueError(f"label {entry!r}: write it as key=value")
        if key in labels:
            raise ValueError(f"label {key!r} given twice")
        labels[key] = value
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels")
    return labels


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINYARD_", env_file=None, extra="ignore")

    database_url: str = Field(
        default="",
        description="SQLAlchemy async URL. Empty: the embedded SQLite file "
        "`<data_dir>/trainyard.db`, created on first run. For Postgres: "
        "`postgresql+asyncpg://user@host:5432/db`.",
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated bearer API keys. Empty: no authentication. Health "
        "endpoints and the API docs stay open either way (`/metrics`: see "
        "`metrics_public`). A value with no key in it (`,`, blanks) is refused at start.",
    )
    metrics_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated bearer keys that read `/metrics` and nothing else (what "
        "Prometheus scrapes with). An admin key reads it too.",
    )
    metrics_public: bool = Field(
        default=False,
        description="Serve `/metrics` without a key. Off: where keys are set, only an admin "
        "key or a `metrics_keys` key reads it, since its labels name every project and model.",
    )
    key_cache_seconds: float = Field(
        default=2.0,
        ge=0,
        description="How long a process trusts what it read of a project key (and whether "
        "any key exists) before reading it again: a revoked or expired key is refused "
        "within this many seconds on every replica. 0: read on every request.",
    )
    key_last_used_seconds: float = Field(
        default=60.0,
        ge=0,
        description="A project key's `last_used_at` is written at most this often per key, "
        "off the request path.",
    )
    audit_retention_seconds: float = Field(
        default=90 * 86400.0,
        gt=0,
        description="How long an audit event is kept; workers delete older ones in small "
        "batches, as they do the webhook log.",
    )
    max_body_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="Largest request body accepted; larger bodies get 413 before parsing.",
    )
    max_json_depth: int = Field(
        default=64,
        ge=8,
        le=128,
        description='How deep arrays and objects may nest in a request body (`{"a": [1]}` '
        "is 2 deep); deeper gets 422. At most 128, so that every stored spec reads back.",
    )
    max_groups_per_job: int = Field(
        default=10_000,
        ge=1,
        description="Groups one training job may hold (NAT: the collection's groups); more "
        "gets 413.",
    )
    max_trajectories_per_group: int = Field(
        default=1_000, ge=1, description="Trajectories one group may hold; more gets 413."
    )
    max_items_per_trajectory: int = Field(
        default=10_000,
        ge=1,
        description="Items (messages, choices, NAT episode items) and tools one trajectory "
        "may hold, and messages one rollout example may hold; more gets 413.",
    )
    max_logprob_tokens_per_job: int = Field(
        default=1_000_000,
        ge=1,
        description="Logprob entries one training job may hold, over all its turns: tokens "
        "(`content`, `refusal`) and their `top_logprobs`; more gets 413.",
    )
    body_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="How long a client has to send a request's whole body; a slower one gets "
        "408 and the connection is closed.",
    )
    header_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="How long a client has to send a request's line and headers once it "
        "connected or started the request (`trainyard serve`); a slower one gets 408.",
    )
    max_header_bytes: int = Field(
        default=32 * 1024,
        ge=1024,
        le=1024 * 1024,
        description="Largest request line plus headers (`trainyard serve`); larger gets 431.",
    )
    keep_alive_seconds: int = Field(
        default=5,
        ge=1,
        le=600,
        description="How long `trainyard serve` keeps an idle keep-alive connection open.",
    )
    model_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated directories, besides <data_dir>, that cpu models may "
        "load their `base_model` from. Any other path is refused at registration.",
    )
    worker_enabled: bool = Field(
        default=True,
        description="Run a job worker inside `trainyard serve`. Turn off when workers run as "
        "separate `trainyard worker` processes.",
    )
    worker_concurrency: int = Field(
        default=4, ge=1, description="Jobs one worker runs at once (at most one per model)."
    )
    worker_pool: str = Field(
        default="default",
        pattern=POOL_PATTERN,
        description="Pool a `trainyard worker` serves (`--pool`): it claims only jobs of "
        "models in this pool (a model without a pool is in `default`).",
    )
    worker_backends: Annotated[list[str] | None, NoDecode] = Field(
        default=None,
        description="Comma-separated backends a worker runs (`--backends`, e.g. "
        "`cpu,dry-run`); it claims only jobs of models on them. Empty: every backend this "
        "process can load (art-local needs CUDA and the gpu extra, art-serverless "
        "WANDB_API_KEY).",
    )
    worker_labels: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="Labels of a worker (`--labels`, `k=v,k=v`, e.g. `gpu=h200,zone=a`): it "
        "claims a model's jobs only if it has every label the model asks for.",
    )
    lease_seconds: float = Field(
        default=30.0,
        gt=0,
        description="How long a claimed job stays leased without a heartbeat before another "
        "worker may recover it.",
    )
    heartbeat_seconds: float = Field(
        default=5.0, gt=0, description="Interval between lease renewals of a running job."
    )
    poll_seconds: float = Field(
        default=2.0,
        gt=0,
        description="Fallback poll interval of an idle worker (wake-ups are immediate).",
    )
    max_attempts: int = Field(
        default=3, ge=1, description="Attempts before a job that keeps failing transiently fails."
    )
    retry_base_seconds: float = Field(
        default=2.0, ge=0, description="First retry delay; doubles per attempt, with jitter."
    )
    sqlite_busy_timeout_seconds: float = Field(
        default=5.0,
        ge=0,
        le=600,
        description="How long a SQLite statement waits for another connection's write lock "
        "before the request answers 503 with Retry-After (the worker retries).",
    )
    migrate_on_start: bool = Field(
        default=True, description="Upgrade the database schema to head when the service starts."
    )
    data_dir: Path = Field(
        default=DEFAULT_DATA_DIR,
        description="Where the embedded database and backend checkpoints live.",
    )
    cpu_device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="Where the cpu backend's models run: `auto` (the first CUDA device torch "
        "sees, else the CPU), `cpu`, `cuda` or `cuda:N`. The same trainer and server run on a "
        "GPU worker.",
    )
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description="Torch's threads for the cpu backend's models, in each process (server, "
        "worker, serving pool): unset, every CPU the process may use (those it may run on, "
        "capped by its container's CPU limit) but one.",
    )
    checkpoint_url: str | None = Field(
        default=None,
        description="Where the cpu and dry-run backends keep checkpoints. Empty: under "
        "<data_dir> (one machine). An absolute directory or `file:///dir`: that directory "
        "(e.g. a volume every worker mounts). `s3://bucket/prefix`: an S3-compatible object "
        "store every worker and API process reads and writes; each keeps a local cache.",
    )
    checkpoint_s3_endpoint: str | None = Field(
        default=None,
        description="The object store's endpoint, e.g. `http://minio:9000`. Empty: AWS S3 "
        "(or `AWS_ENDPOINT_URL`).",
    )
    checkpoint_s3_region: str | None = Field(
        default=None, description="The bucket's region. Empty: `AWS_REGION`, else us-east-1."
    )
    checkpoint_s3_access_key_id: str | None = Field(
        default=None,
        description="Access key id. Empty: `AWS_ACCESS_KEY_ID` and the rest of "
        "the AWS environment (`AWS_*` variables, an instance, task or web-identity role).",
    )
    checkpoint_s3_secret_access_key: SecretStr | None = Field(
        default=None, description="Secret access key. Empty: `AWS_SECRET_ACCESS_KEY`."
    )
    checkpoint_cache_bytes: int = Field(
        default=20 * 1024**3,
        ge=0,
        description="With an `s3://` checkpoint URL: how many bytes of checkpoints a process "
        "keeps in `<data_dir>/checkpoint-cache` (what it wrote or loaded); the least "
        "recently used steps are evicted first, never the one in use.",
    )
    demo_model: bool = Field(
        default=False,
        description="At start, make a tiny model under <data_dir>/tiny-model and register it "
        "as `demo` on the cpu backend, served and ready to train (`make run` turns this on).",
    )
    cpu_inference_host: str = Field(
        default="127.0.0.1", description="Address the cpu backend's inference endpoint binds."
    )
    cpu_inference_port: int = Field(
        default=0, ge=0, le=65535, description="Its port; 0 picks a free one at start."
    )
    serving_max_tokens: int = Field(
        default=131_072,
        ge=1,
        description="Work admitted per served model at once, in flight and queued, counted in "
        "tokens (`n x max_tokens` of each chat request). Past it the gateway and the cpu "
        "backend's endpoint answer 429 with `Retry-After` (runs and rollouts wait their turn). "
        "A model with nothing admitted takes any one request.",
    )
    serving_pools: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Serving pools apart from the trainers, as JSON: a base model (as models "
        "name it in `base_model`) to the base URLs of its replicas, e.g. "
        '`{"/models/qwen": ["http://pool-a:8000/v1", "http://pool-b:8000/v1"]}`. The gateway '
        "serves every step of a model on such a base from its pool (vLLM with runtime LoRA "
        "updating, or `trainyard serve-pool`), loading each step's adapter as `name@N`.",
    )
    prices: dict[str, float] = Field(
        default_factory=dict,
        description="Prices for the estimated cost of jobs, runs and `GET /v1/usage`, as "
        "JSON: per trainer-hour (`trainer_hour`: training jobs), per rollout-hour "
        "(`rollout_hour`: rollout and evaluation jobs, sampling and grading), per million "
        "tokens sampled (`sampled_mtok`: prompt and completion tokens) and per million tokens "
        "trained (`trained_mtok`); each for every model, or for one base model's or one "
        "backend's (`trainer_hour:cpu`, `sampled_mtok:Qwen/Qwen2.5-7B-Instruct`; a base "
        'model\'s wins over a backend\'s), e.g. `{"trainer_hour": 2.5, "trainer_hour:cpu": '
        '0.1, "sampled_mtok": 0.2}`. A price not given is 0.',
    )
    price_currency: str = Field(
        default="USD",
        pattern=r"^[A-Z]{3}$",
        description="The currency of `TRAINYARD_PRICES` (an ISO 4217 code).",
    )
    serving_retry_after_seconds: int = Field(
        default=1, ge=1, le=3600, description="`Retry-After` of a 429 for a saturated model."
    )
    public_url: str = Field(
        default="",
        description="The URL clients reach this API at, e.g. `https://trainyard.example`: "
        "models show their gateway URL under it. Empty: the URL of each request.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Log level of the service."
    )
    egress_allow: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated destinations agent services and webhook graders may "
        "reach: addresses, networks (CIDR), host names, `*.domain`, `loopback`, `private`. "
        "Empty: any destination not denied. When set, nothing else is reached; a network "
        "listed here also lifts the default refusal of special-use addresses in it.",
    )
    egress_deny: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated destinations agent services and webhook graders must "
        "never reach, in the same forms (e.g. `loopback,private`); wins over "
        "`TRAINYARD_EGRESS_ALLOW`. Special-use addresses (link-local and the cloud metadata "
        "address, unspecified, multicast, broadcast, reserved, documentation, ...) are "
        "refused by default too, unless `TRAINYARD_EGRESS_ALLOW` lists their network.",
    )
    agent_max_response_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1024,
        description="Largest answer of an agent service, once decoded; a larger one is "
        "recorded as that answer's error.",
    )
    webhook_retry_schedule: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0],
        min_length=1,
        description="Comma-separated seconds a webhook delivery waits before each retry after "
        "a failed attempt (default 5 s, 5 min, 30 min, 2 h, 5 h, 10 h: about 17 h in all); "
        "when they are spent it is marked failed.",
    )
    webhook_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="How long one webhook attempt may take in all, from connecting to the "
        "answer's last byte; a slower receiver counts as a failed attempt.",
    )
    webhook_concurrency: int = Field(
        default=8, ge=1, le=256, description="Webhook deliveries one worker sends at once."
    )
    webhook_max_in_flight_per_endpoint: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Webhook deliveries of one endpoint in flight at once, across all "
        "workers (one while its last attempt timed out).",
    )
    webhook_max_in_flight_per_host: int = Field(
        default=4,
        ge=1,
        le=1024,
        description="Webhook deliveries to one host (the URL's host name) in flight at "
        "once, across all workers and endpoints.",
    )
    webhook_unproven_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="The share of a worker's webhook slots that endpoints not known to "
        "answer (never answered yet, or whose last attempt timed out) may hold; the rest stay "
        "free for endpoints that answer.",
    )
    webhook_breaker_threshold: int = Field(
        default=5,
        ge=1,
        description="Webhook attempts in a row that timed out after which "
        "an endpoint's circuit breaker opens: nothing is sent to it for "
        "`TRAINYARD_WEBHOOK_BREAKER_SECONDS`, then one delivery at a time until it answers.",
    )
    webhook_breaker_seconds: float = Field(
        default=300.0,
        gt=0,
        description="How long an endpoint's open circuit breaker holds its deliveries "
        "(they wait; no retry is spent).",
    )
    webhook_max_endpoints: int = Field(
        default=100,
        ge=1,
        description="Webhook endpoints each project may have; registering one more in that "
        "project is a 409.",
    )
    webhook_poll_seconds: float = Field(
        default=1.0,
        gt=0,
        description="How often a worker looks for webhook deliveries that are due.",
    )
    webhook_secret_grace_seconds: float = Field(
        default=86400.0,
        ge=0,
        description="After an endpoint's secret is rotated, how long deliveries are signed "
        "with the previous secret too (a receiver holding either accepts them).",
    )
    webhook_retention_seconds: float = Field(
        default=7 * 86400.0,
        gt=0,
        description="How long a webhook delivery that ended (succeeded or failed) is kept, "
        "with its attempts; workers delete older ones in small batches.",
    )
    host: str = Field(default="127.0.0.1", description="Address `trainyard serve` binds.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port `trainyard serve` binds.")

    @field_validator("api_keys", "metrics_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            keys = [key.strip() for key in value.split(",") if key.strip()]
            if value and not keys:
                # `,` or blanks: someone meant to set keys and set none. Running without
                # authentication is what an empty value asks for, never what a typo gets.
                raise ValueError(
                    "no key in it, only commas or blanks: set "
                    "comma-separated keys, or leave it empty to run without authentication"
                )
            return keys
        return value

    @field_validator("worker_backends", mode="before")
    @classmethod
    def _split_backends(cls, value: object) -> object:
        if isinstance(value, str):
            return [entry.strip() for entry in value.split(",") if entry.strip()] or None
        return value

    @field_validator("worker_labels", mode="before")
    @classmethod
    def _labels(cls, value: object) -> object:
        return parse_labels(value) if isinstance(value, str) else value

    @field_validator("worker_labels")
    @classmethod
    def _label_grammar(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            refusal = label_refusal(key, label)
            if refusal:
                raise ValueError(refusal)
        return value

    @field_validator(
        "model_roots", "egress_allow", "egress_deny", "webhook_retry_schedule", mode="before"
    )
    @classmethod
    def _split_lists(cls, value: object) -> object:
        if isinstance(value, str):
            return [entry.strip() for entry in value.split(",") if entry.strip()]
        return value

    def allowed_model_roots(self) -> list[Path]:
        """Where cpu models may load from: the data directory and `model_roots`, absolute."""
        return [Path(root).absolute() for root in (self.data_dir, *self.model_roots)]

    @field_validator(
        "checkpoint_url",
        "checkpoint_s3_endpoint",
        "checkpoint_s3_region",
        "checkpoint_s3_access_key_id",
        "checkpoint_s3_secret_access_key",
        "cpu_threads",
        mode="before",
    )
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("checkpoint_url")
    @classmethod
    def _checkpoint_url(cls, value: str | None) -> str | None:
        if value is not None:
            parse_checkpoint_url(value)
        return value

    @field_validator("serving_pools")
    @classmethod
    def _pools(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for base, replicas in value.items():
            if not base:
                raise ValueError("a base model name is not empty")
            if not replicas:
                raise ValueError(f"the pool of {base!r} lists at least one replica URL")
            for url in replicas:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"{url!r} (pool of {base!r}) is an http:// or https:// URL")
        return {base: [url.rstrip("/") for url in replicas] for base, replicas in value.items()}

    @field_validator("prices")
    @classmethod
    def _prices(cls, value: dict[str, float]) -> dict[str, float]:
        for name, price in value.items():
            unit, _, backend = name.partition(":")
            if unit not in PRICE_UNITS or (name != unit and not backend):
                raise ValueError(
                    f"{name!r}: a price is `trainer_hour`, `rollout_hour`, `sampled_mtok` or "
                    "`trained_mtok`, or one of them with `:<backend>` or `:<base model>`"
                )
            if not math.isfinite(price) or price < 0:
                raise ValueError(f"{name!r}: a price is a finite number >= 0")
        return value

    @field_validator("checkpoint_s3_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("an http:// or https:// URL")
        return value

    @field_validator("egress_allow", "egress_deny")
    @classmethod
    def _destinations(cls, value: list[str]) -> list[str]:
        Rule.parse(value)  # the policy's own parser says what an entry may be
        return value

    @field_validator("webhook_retry_schedule")
    @classmethod
    def _delays(cls, value: list[float]) -> list[float]:
        if any(not 0 <= delay <= 7 * 24 * 3600 for delay in value):
            raise ValueError("each delay is between 0 and 604800 seconds (a week)")
        return value

    @model_validator(mode="after")
    def _embedded_database(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite+aiosqlite:///{self.data_dir / 'trainyard.db'}"
        return self


def parse_checkpoint_url(url: str) -> tuple[Literal["file", "s3"], str, str]:
    """(scheme, location, prefix): `file`, the directory, "" for a local directory (an
    absolute path or `file:///dir`); `s3`, the bucket, the key prefix for an object store.
    Raises ValueError naming what a URL must be."""
    if url.startswith("/"):
        return "file", url, ""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"{url!r}: a file URL names an absolute directory (file:///dir)")
        return "file", parts.path, ""
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"{url!r}: an s3 URL names a bucket (s3://bucket/prefix)")
        if parts.query or parts.fragment:
            raise ValueError(f"{url!r}: an s3 URL has no query or fragment")
        return "s3", parts.netloc, parts.path.strip("/")
    raise ValueError(
        f"{url!r}: a checkpoint URL is an absolute directory, file:///dir or s3://bucket/prefix"
    )


PRICE_UNITS = ("trainer_hour", "rollout_hour", "sampled_mtok", "trained_mtok")


@lru_cache
def get_settings() -> Settings:
    return Settings()
