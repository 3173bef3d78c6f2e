"""Wire types of workers: what each live worker runs and can run."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class Worker(BaseModel):
    """A live worker process: it heartbeats, and claims only jobs it can run."""

    id: str = Field(description="`host:pid:random`, as its claim events name it.")
    host: str
    pid: int
    pool: str = Field(description="The pool it serves: it claims jobs of models in it only.")
    backends: list[str] = Field(description="Backends it runs; it claims their models' jobs.")
    labels: dict[str, str] = Field(
        description="Its labels; a model's jobs need every label the model asks for."
    )
    version: str | None = Field(description="Trainyard version it runs.")
    started_at: datetime
    heartbeat_at: datetime = Field(
        description="Its last heartbeat; a worker silent for the lease time is gone."
    )
    jobs: list[str] = Field(
        description="Ids of the jobs it runs now (for a key that is not admin: of its project)."
    )
    draining: bool = Field(
        description="It stopped claiming (a drain was asked, or it got SIGTERM) and is "
        "finishing or handing back what it runs; it exits after."
    )
    drain_requested_at: datetime | None = Field(description="When a drain was asked of it.")
