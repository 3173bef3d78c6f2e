"""The `trainer_adapters` block that selects Trainyard in a NAT config."""

from __future__ import annotations

from typing import Any, Literal

from nat.data_models.finetuning import TrainerAdapterConfig
from pydantic import Field, SecretStr


# NAT's base class takes the `_type` name as a class keyword (NAT's types are Any to mypy).
class TrainyardTrainerAdapterConfig(TrainerAdapterConfig, name="trainyard_trainer_adapter"):  # type: ignore[call-arg]
    """Train on a Trainyard server: each epoch's trajectories become one training job of
    `model`, one gradient step.

    ```yaml
    trainer_adapters:
      trainyard:
        _type: trainyard_trainer_adapter
        url: http://localhost:8000
        model: demo
        hyperparameters: {learning_rate: 1.0e-5}
    ```
    """

    url: str | None = Field(
        default=None,
        description="Trainyard's URL (default: TRAINYARD_URL, then http://127.0.0.1:8000).",
    )
    api_key: SecretStr | None = Field(
        default=None, description="An API key of the server (default: TRAINYARD_API_KEY)."
    )
    model: str = Field(description="The Trainyard model to train (`GET /v1/models`).")
    method: Literal["rl", "dpo"] = Field(
        default="rl",
        description="`rl`: each epoch's trajectories train one RL step. `dpo`: they are "
        "DPO items (NAT's DPO trajectory builder) and train one DPO step; a collection of "
        "DPO items is sent as a DPO job whatever this says.",
    )
    hyperparameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Training keywords of the model's backend for `method` (`GET "
        "/v1/backends`), checked when the adapter starts, before any rollout.",
    )
    metadata: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Labels put on every job (with `nat_run_id` and `nat_submission`), "
        "to filter jobs by: `GET /v1/training-jobs?metadata.KEY=value`.",
    )
    job_timeout: float | None = Field(
        default=None,
        gt=0,
        description="Seconds to wait for one job to end; past them the epoch fails (the "
        "job goes on). None: no limit.",
    )
    request_timeout: float = Field(default=30.0, gt=0, description="Seconds per HTTP request.")
    max_retries: int = Field(
        default=5,
        ge=0,
        description="Retries of a request that could not connect or got 429/503 (submits "
        "repeat their Idempotency-Key: a retry never makes a second job).",
    )
