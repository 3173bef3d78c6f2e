"""The SDK's `RestClient` views of Tinker runs, read from the registry: a training run is a
model labelled `tinker` (its `project`; it belongs to the project of the key that made it),
its checkpoints the model's steps on disk, named by the paths this process saved or by their
aliases (`state-<name>`: a state, `<name>`: sampler weights; an unnamed step is sampler
weights `<step:06d>`)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.models import ModelAliasRow, ModelRow

PROJECT = "tinker"
SCHEME = "tinker://"
STATE_PREFIX = "state-"


def run_name(training_run_id: str) -> str:
    """The registry model of a run named either way: `tinker-<session>-<seq>` (a path's run)
    or the SDK's model id `<session>:train:<seq>`."""
    session, sep, seq = training_run_id.partition(":train:")
    return f"tinker-{session}-{seq}" if sep else training_run_id


async def checkpoints(
    session: AsyncSession, dirs: Any, saved: dict[str, tuple[str, int]], name: str
) -> list[dict[str, Any]]:
    """The run's checkpoints, oldest first, as the SDK's `Checkpoint`."""
    steps: dict[int, datetime] = await asyncio.to_thread(dirs.steps, _Named(name))
    labels: dict[int, list[tuple[str, str]]] = {}
    for path, (model, step) in saved.items():
        if model == name:
            _, kind, label = path.removeprefix(SCHEME).split("/")
            labels.setdefault(step, []).append((kind, label))
    rows = await session.scalars(select(ModelAliasRow).where(ModelAliasRow.model_name == name))
    for row in rows:
        if row.alias.startswith(STATE_PREFIX):
            named = ("weights", row.alias.removeprefix(STATE_PREFIX))
        else:
            named = ("sampler_weights", row.alias)
        if named not in labels.get(row.step, []):
            labels.setdefault(row.step, []).append(named)
    found = []
    for step, written in sorted(steps.items()):
        for kind, label in labels.get(step) or [("sampler_weights", f"{step:06d}")]:
            found.append(
                {
                    "checkpoint_id": f"{kind}/{label}",
                    "checkpoint_type": "training" if kind == "weights" else "sampler",
                    "time": written.isoformat(),
                    "tinker_path": f"{SCHEME}{name}/{kind}/{label}",
                }
            )
    return found


async def training_run(
    session: AsyncSession, dirs: Any, saved: dict[str, tuple[str, int]], row: ModelRow
) -> dict[str, Any]:
    """A run as the SDK's `TrainingRun`."""
    found = await checkpoints(session, dirs, saved, row.name)
    by_type = {c["checkpoint_type"]: c for c in found}  # the newest of each type
    config = row.config or {}
    last = max((c["time"] for c in found), default=None)
    return {
        "training_run_id": row.name,
        "base_model": row.base_model,
        "model_owner": PROJECT,
        "is_lora": True,
        "lora_rank": config.get("lora_rank"),
        "last_request_time": last or datetime.now(UTC).isoformat(),
        "last_checkpoint": by_type.get("training"),
        "last_sampler_checkpoint": by_type.get("sampler"),
    }


async def training_runs(
    session: AsyncSession,
    dirs: Any,
    saved: dict[str, tuple[str, int]],
    limit: int,
    offset: int,
    *,
    sees: str | None,
) -> dict[str, Any]:
    """A page of runs, by name, as the SDK's `TrainingRunsResponse`: those of project `sees`
    (None: every project's)."""
    query = _runs(sees, ModelRow)
    total = await session.scalar(select(func.count()).select_from(query.subquery()))
    rows = (await session.scalars(query.order_by(ModelRow.name).limit(limit).offset(offset))).all()
    return {
        "training_runs": [await training_run(session, dirs, saved, row) for row in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": int(total or 0)},
    }


async def user_checkpoints(
    session: AsyncSession,
    dirs: Any,
    saved: dict[str, tuple[str, int]],
    page: tuple[int, int],
    sees: str | None,
) -> dict[str, Any]:
    """A page (`limit`, `offset`) of every checkpoint of project `sees`'s runs (None: every
    project's), newest first, as the SDK's `CheckpointsListResponse`."""
    limit, offset = page
    names = (await session.scalars(_runs(sees, ModelRow.name).order_by(ModelRow.name))).all()
    found = [  # each names its run in its `tinker_path`
        checkpoint for name in names for checkpoint in await checkpoints(session, dirs, saved, name)
    ]
    found.sort(key=lambda c: (c["time"], c["tinker_path"]), reverse=True)
    return {
        "checkpoints": found[offset : offset + limit],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(found)},
    }


def _runs(sees: str | None, *columns: Any) -> Any:
    """The Tinker runs of project `sees` (None: every project's)."""
    query = select(*columns).where(ModelRow.project == PROJECT)
    return query if sees is None else query.where(ModelRow.project_id == sees)


class _Named:
    project = PROJECT

    def __init__(self, name: str) -> None:
        self.name = name
