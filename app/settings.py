"""Service configuration: one settings class, every field from a `TRAINYARD_` variable."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_DATA_DIR = Path("var")


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
        description="Comma-separated bearer API keys. Empty: no authentication. Health and "
        "metrics endpoints stay open either way.",
    )
    max_body_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="Largest request body accepted; larger bodies get 413 before parsing.",
    )
    worker_enabled: bool = Field(
        default=True,
        description="Run a job worker inside `trainyard serve`. Turn off when workers run as "
        "separate `trainyard worker` processes.",
    )
    worker_concurrency: int = Field(
        default=4, ge=1, description="Jobs one worker runs at once (at most one per model)."
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
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Log level of the service."
    )
    host: str = Field(default="127.0.0.1", description="Address `trainyard serve` binds.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port `trainyard serve` binds.")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @model_validator(mode="after")
    def _embedded_database(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite+aiosqlite:///{self.data_dir / 'trainyard.db'}"
        return self


@lru_cache
def get_settings() -> Settings:
    return Settings()
