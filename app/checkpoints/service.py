"""The checkpoint registry's rules: list, delete, aliases, retention, export.

The source of truth is what the model's backend keeps on disk (one `{step:04d}` directory
per step, `TrainerAdapter.checkpoints_dir`), joined with the succeeded training jobs that
made each step (`final_step`, `metrics`). Aliases and retention policies are rows. With an
object store (`TRAINYARD_CHECKPOINT_URL=s3://…`) "on disk" means in the store: listed from
its manifests, exported through this process's cache.

A step is **protected** (`protected`): deleting it is refused with 409, and retention never
deletes it, while any of these holds:

- it is the latest step: the newest checkpoint on disk (the next job trains from it), or
  the model's `current_step` (the gateway serves it as `name`);
- an alias points at it: a user-defined one, or `best` under the retention policy;
- a queued or running job of the model needs it: its `policy_step` is that step (its
  trajectories were sampled from it), or, running, its `start_step` is.

Deleting (one step, or retention) holds the model's row lock (Postgres `FOR UPDATE`;
SQLite's write lock) from reading the protections to the deletion, and so does setting an
alias: an alias set meanwhile cannot point at a step being deleted. The deletion itself is
local disk work through the backend (`art.Backend._delete_checkpoint_files`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from app.backends import Backends
from app.backends.base import BackendError, ModelSpec, TrainerAdapter
from app.backends.checkpoints import CheckpointDirs
from app.backends.cpu import base_model_refusal
from app.checkpoints import disk, merge
from app.db import begin_write
from app.errors import (
    ConflictError,
    InvalidInputError,
    NotFoundError,
    UnavailableError,
    not_found,
)
from app.jobs.lifecycle import JobKind, JobStatus
from app.models import JobRow, ModelAliasRow, ModelRow, RetentionPolicyRow, RunMetricRow
from app.schemas.checkpoints import (
    BUILTIN_ALIASES,
    Alias,
    Checkpoint,
    ExportFormat,
    RetentionPolicy,
    RetentionPolicyIn,
    RetentionRun,
)
from app.schemas.common import FieldError

log = logging.getLogger(__name__)
# Whether a model has a retention policy, as a worker last read it: the check after each
# step must not cost every job a query (the queue's hot path). A policy set or removed in
# this process is seen at once; one set in another process within POLICY_TTL_SECONDS.
POLICY_TTL_SECONDS = 5.0
_has_policy: dict[str, tuple[float, bool]] = {}

LATEST, BEST = "latest", "best"
ARCHIVE_MEDIA_TYPE = "application/octet-stream"
"""Of both archive formats (the file name says which): what every client generator reads
as bytes."""


class NoLocalCheckpointsError(ConflictError):
    slug = "no-local-checkpoints"


class CheckpointProtectedError(ConflictError):
    slug = "checkpoint-protected"


class NoAdapterError(ConflictError):
    slug = "no-adapter"


class BaseNotLocalError(ConflictError):
    slug = "base-not-local"


class NotMergeableError(ConflictError):
    slug = "not-mergeable"


def _error(
    location: Literal["path", "body", "query"], path: str, message: str, kind: str
) -> FieldError:
    return FieldError(location=location, path=path, message=message, type=kind)


# -- where a model's checkpoints are ------------------------------------------------------


@dataclass(frozen=True)
class Place:
    """Where a model's checkpoints are: a local directory, or (`shelved`) an object store
    with this process's cache of it in `directory`."""

    row: ModelRow
    spec: ModelSpec
    adapter: TrainerAdapter
    directory: Path

    @property
    def shelved(self) -> CheckpointDirs | None:
        dirs = self.adapter.checkpoint_dirs()
        return dirs if dirs is not None and dirs.shelf is not None else None

    async def steps(self) -> dict[int, Path]:
        """The complete steps, by step: their directories here (with an object store,
        where the cache keeps them, whether it holds them now or not)."""
        dirs = self.shelved
        if dirs is None:
            return await asyncio.to_thread(disk.steps, self.directory)
        steps = await asyncio.to_thread(dirs.steps, self.spec)
        return {step: self.directory / f"{step:04d}" for step in steps}

    def stat(self, step: int, path: Path) -> disk.Stat | None:
        """Size and time of a step (synchronous: call in a thread); None: it is gone."""
        dirs = self.shelved
        if dirs is None or dirs.shelf is None:
            return disk.stat(path)
        info = dirs.shelf.store.info(dirs.shelf.key(dirs._relative(self.spec)), step)
        return None if info is None else disk.Stat(info.size_bytes, info.written_at)

    async def local(self, step: int, path: Path) -> Path | None:
        """The step's directory on this machine (fetched into the cache on a miss)."""
        dirs = self.shelved
        if dirs is None:
            return path
        return await asyncio.to_thread(dirs.local_step, self.spec, step)


async def _model(session: AsyncSession, name: str, *, lock: bool = False) -> ModelRow:
    """The model's row; `lock`: in a writing transaction, holding the row's lock."""
    query = select(ModelRow).where(ModelRow.name == name)
    if lock:
        await begin_write(session)
        query = query.with_for_update()
    row = await session.scalar(query)
    if row is None:
        raise not_found("model", name, param="name")
    return row


def _place(row: ModelRow, backends: Backends) -> Place:
    spec = ModelSpec(row.name, row.project, row.base_model, row.config)
    try:
        adapter = backends.get(row.backend)
        directory = adapter.checkpoints_dir(spec)
    except BackendError as exc:
        if exc.transient:
            raise UnavailableError(
                f"backend {row.backend!r} is unreachable: {exc}", headers={"Retry-After": "1"}
            ) from exc
        raise NoLocalCheckpointsError(
            f"the checkpoints of {row.name!r} cannot be read here: {exc}"
        ) from exc
    if directory is None:
        raise NoLocalCheckpointsError(
            f"model {row.name!r} is on backend {row.backend!r}, which keeps no checkpoints "
            "on this machine: nothing to list, delete, alias, retain or export"
        )
    return Place(row, spec, adapter, directory)


async def _locate(
    session: AsyncSession, backends: Backends, name: str, *, lock: bool = False
) -> tuple[Place, dict[int, Path]]:
    place = _place(await _model(session, name, lock=lock), backends)
    return place, await place.steps()


def _missing_step(name: str, step: int) -> NotFoundError:
    detail = f"model {name!r} has no checkpoint of step {step}"
    return not_found("checkpoint", step, param="step", detail=detail)


# -- what points at which step ------------------------------------------------------------


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


async def best_step(
    session: AsyncSession, name: str, policy: RetentionPolicyRow | None, on_disk: Collection[int]
) -> int | None:
    """The checkpoint on disk whose training job has the best `keep_best_by` metric (the
    newest of equals); None without such a metric."""
    if policy is None or policy.keep_best_by is None or not on_disk:
        return None
    query = select(JobRow.final_step, JobRow.metrics[policy.keep_best_by]).where(
        JobRow.model_name == name,
        JobRow.kind == JobKind.training.value,
        JobRow.status == JobStatus.succeeded.value,
        JobRow.final_step.is_not(None),
    )
    values: dict[int, float] = {}
    for step, raw in (await session.execute(query)).all():
        value = _finite(raw)
        if step in on_disk and value is not None:
            values[step] = value if policy.higher_is_better else -value
    if not values:
        return None
    return max(values, key=lambda step: (values[step], step))


async def _user_aliases(session: AsyncSession, name: str) -> list[ModelAliasRow]:
    query = select(ModelAliasRow).where(ModelAliasRow.model_name == name)
    return list((await session.scalars(query.order_by(ModelAliasRow.alias))).all())


async def _builtins(
    session: AsyncSession, name: str, on_disk: Collection[int], policy: RetentionPolicyRow | None
) -> dict[str, int]:
    builtins: dict[str, int] = {}
    if on_disk:
        builtins[LATEST] = max(on_disk)
    best = await best_step(session, name, policy, on_disk)
    if best is not None:
        builtins[BEST] = best
    return builtins


async def _policy(session: AsyncSession, name: str) -> RetentionPolicyRow | None:
    return await session.get(RetentionPolicyRow, name)


async def protected(
    session: AsyncSession, row: ModelRow, on_disk: Collection[int]
) -> dict[int, list[FieldError]]:
    """Why each protected step may not be deleted (see the module's docstring)."""
    name = row.name
    reasons: dict[int, list[FieldError]] = defaultdict(list)

    def add(step: int, message: str, kind: str) -> None:
        reasons[step].append(_error("path", "step", message, kind))

    if on_disk:
        add(max(on_disk), "it is the latest step: the next job trains from it", "latest_step")
    if row.current_step not in reasons:
        add(
            row.current_step,
            f"it is the model's current step (the gateway serves it as `{name}`)",
            "latest_step",
        )
    for alias in await _user_aliases(session, name):
        add(alias.step, f"the alias `{alias.alias}` points at it", "aliased_step")
    policy = await _policy(session, name)
    best = await best_step(session, name, policy, on_disk)
    if best is not None and policy is not None:
        add(best, f"the alias `best` (by `{policy.keep_best_by}`) points at it", "aliased_step")
    active = (JobStatus.queued.value, JobStatus.running.value)
    query = select(JobRow.id, JobRow.status, JobRow.policy_step, JobRow.start_step).where(
        JobRow.model_name == name, JobRow.status.in_(active)
    )
    for job_id, status, policy_step, start_step in (await session.execute(query)).all():
        if policy_step is not None:
            add(policy_step, f"{status} job {job_id} was sampled from it", "step_in_use")
        if status == JobStatus.running.value and start_step is not None:
            add(start_step, f"running job {job_id} started from it", "step_in_use")
    return dict(reasons)


# -- checkpoints ------------------------------------------------------------------------------


async def _jobs_by_step(
    session: AsyncSession, name: str, steps: Iterable[int]
) -> dict[int, tuple[str, dict[str, Any] | None]]:
    wanted = list(steps)
    if not wanted:
        return {}
    query = (
        select(JobRow.id, JobRow.final_step, JobRow.metrics)
        .where(
            JobRow.model_name == name,
            JobRow.kind == JobKind.training.value,
            JobRow.status == JobStatus.succeeded.value,
            JobRow.final_step.in_(wanted),
        )
        .order_by(JobRow.id)  # time-ordered: the newest job of a step wins
    )
    return {step: (job_id, metrics) for job_id, step, metrics in await session.execute(query)}


async def _validations_by_step(
    session: AsyncSession, name: str, steps: Iterable[int]
) -> dict[int, dict[str, Any]]:
    """The latest run validation of each step: its score and which run and job."""
    wanted = list(steps)
    if not wanted:
        return {}
    query = (
        select(RunMetricRow.run_id, RunMetricRow.step, RunMetricRow.data)
        .join(JobRow, JobRow.id == RunMetricRow.run_id)
        .where(
            JobRow.model_name == name,
            RunMetricRow.kind == "validation",
            RunMetricRow.step.in_(wanted),
        )
        .order_by(RunMetricRow.run_id, RunMetricRow.seq)
    )
    found: dict[int, dict[str, Any]] = {}
    for run_id, step, data in await session.execute(query):
        found[step] = {
            "score": data.get("score"),
            "run_id": run_id,
            "job_id": data.get("job_id"),
        }
    return found


async def _describe(
    session: AsyncSession, place: Place, on_disk: dict[int, Path], page: list[int]
) -> list[Checkpoint]:
    name = place.row.name
    names: dict[int, list[str]] = defaultdict(list)
    builtins = await _builtins(session, name, on_disk, await _policy(session, name))
    for alias, step in sorted(builtins.items(), key=lambda item: item[0] != LATEST):
        names[step].append(alias)
    for row in await _user_aliases(session, name):
        names[row.step].append(row.alias)
    jobs = await _jobs_by_step(session, name, page)
    validated = await _validations_by_step(session, name, page)
    stats = await asyncio.to_thread(_stats, place, on_disk, page)
    checkpoints = []
    for step in page:
        stat = stats[step]
        if stat is None:  # deleted meanwhile
            continue
        job_id, metrics = jobs.get(step, (None, None))
        checkpoints.append(
            Checkpoint(
                step=step,
                created_at=stat.written_at,
                job_id=job_id,
                metrics=metrics,
                validation_metrics=validated.get(step),
                size_bytes=stat.size_bytes,
                aliases=names.get(step, []),
            )
        )
    return checkpoints


def _stats(place: Place, on_disk: dict[int, Path], page: list[int]) -> dict[int, disk.Stat | None]:
    """Each step's size and time: from disk, or a manifest GET each (eight at a time)."""
    if len(page) < 2 or place.shelved is None:
        return {s: place.stat(s, on_disk[s]) for s in page}
    with ThreadPoolExecutor(min(8, len(page))) as pool:
        return dict(zip(page, pool.map(lambda s: place.stat(s, on_disk[s]), page), strict=True))


async def bytes_kept(row: ModelRow, backends: Backends) -> int | None:
    """The bytes the model's checkpoints take now (`GET /v1/usage`); None: this process
    cannot read them (its backend keeps none here, or is away)."""
    try:
        place = _place(row, backends)
        on_disk = await place.steps()
        stats = await asyncio.to_thread(_stats, place, on_disk, sorted(on_disk))
    except (NoLocalCheckpointsError, UnavailableError, BackendError, OSError):
        return None
    return sum(stat.size_bytes for stat in stats.values() if stat is not None)


async def list_checkpoints(
    session: AsyncSession, backends: Backends, *, name: str, after: int | None, limit: int
) -> tuple[list[Checkpoint], str | None]:
    """Newest first; returns the page and the cursor of the next one (None: no more)."""
    place, on_disk = await _locate(session, backends, name)
    ordered = sorted((s for s in on_disk if after is None or s < after), reverse=True)
    page = ordered[:limit]
    cursor = str(page[-1]) if len(ordered) > limit else None
    return await _describe(session, place, on_disk, page), cursor


async def get_checkpoint(
    session: AsyncSession, backends: Backends, *, name: str, step: int
) -> Checkpoint:
    place, on_disk = await _locate(session, backends, name)
    described = await _describe(session, place, on_disk, [step]) if step in on_disk else []
    if not described:
        raise _missing_step(name, step)
    return described[0]


async def _delete(place: Place, on_disk: Collection[int], doomed: Collection[int]) -> None:
    """Delete `doomed` through the backend. Kept: every other step on disk, and the step
    after the newest (a job may be writing it right now: one runs per model)."""
    keep = sorted(set(on_disk) - set(doomed))
    keep.append(max(on_disk) + 1)
    await place.adapter.delete_checkpoints(place.spec, keep)
    left = set(await place.steps()) & set(doomed)
    if left:
        log.warning("model %s: checkpoints %s were not deleted", place.row.name, sorted(left))


async def delete_checkpoint(
    session: AsyncSession, backends: Backends, *, name: str, step: int
) -> None:
    place, on_disk = await _locate(session, backends, name, lock=True)
    if step not in on_disk:
        raise _missing_step(name, step)
    reasons = (await protected(session, place.row, on_disk)).get(step)
    if reasons:
        why = "; ".join(reason.message for reason in reasons)
        raise CheckpointProtectedError(
            f"step {step} of {name!r} cannot be deleted: {why}", errors=reasons
        )
    await _delete(place, on_disk, [step])


# -- aliases --------------------------------------------------------------------------------


def _user_alias_name(alias: str) -> None:
    if alias in BUILTIN_ALIASES:
        raise InvalidInputError(
            f"`{alias}` is a built-in alias: it cannot be set or removed",
            errors=[_error("path", "alias", "a built-in alias", "reserved_alias")],
        )


def _alias_wire(row: ModelAliasRow) -> Alias:
    return Alias(
        alias=row.alias,
        step=row.step,
        builtin=False,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


async def list_aliases(
    session: AsyncSession, backends: Backends, *, name: str, after: str | None, limit: int
) -> tuple[list[Alias], str | None]:
    """By name, the built-in ones among them."""
    _, on_disk = await _locate(session, backends, name)
    builtins = await _builtins(session, name, on_disk, await _policy(session, name))
    query = select(ModelAliasRow).where(ModelAliasRow.model_name == name)
    if after is not None:
        query = query.where(ModelAliasRow.alias > after)
    rows = (await session.scalars(query.order_by(ModelAliasRow.alias).limit(limit + 1))).all()
    aliases = [_alias_wire(row) for row in rows] + [
        Alias(alias=alias, step=step, builtin=True)
        for alias, step in builtins.items()
        if after is None or alias > after
    ]
    aliases.sort(key=lambda alias: alias.alias)
    page = aliases[:limit]
    return page, page[-1].alias if len(aliases) > limit else None


async def set_alias(
    session: AsyncSession, backends: Backends, *, name: str, alias: str, step: int
) -> tuple[Alias, bool]:
    """Point `alias` at `step` (whose checkpoint must be on disk). Returns (it, created)."""
    _user_alias_name(alias)
    _, on_disk = await _locate(session, backends, name, lock=True)
    if step not in on_disk:
        raise InvalidInputError(
            f"model {name!r} has no checkpoint of step {step}",
            errors=[_error("body", "step", "no checkpoint of this step", "unknown_step")],
        )
    row = await session.get(ModelAliasRow, (name, alias))
    created = row is None
    if row is None:
        row = ModelAliasRow(model_name=name, alias=alias, step=step)
        session.add(row)
    else:
        row.step = step
    await session.flush()
    await session.refresh(row)
    return _alias_wire(row), created


async def delete_alias(session: AsyncSession, *, name: str, alias: str) -> None:
    _user_alias_name(alias)
    await _model(session, name, lock=True)
    row = await session.get(ModelAliasRow, (name, alias))
    if row is None:
        detail = f"model {name!r} has no alias {alias!r}"
        raise not_found("alias", alias, param="alias", detail=detail)
    await session.delete(row)
    await session.flush()


async def resolve_alias(
    session: AsyncSession, backends: Backends, row: ModelRow, alias: str
) -> int | None:
    """The step `name@alias` names (`latest` aside: the caller's); None: no such alias."""
    if alias == BEST:
        try:
            place = _place(row, backends)
        except ConflictError:
            return None
        policy = await _policy(session, row.name)
        return await best_step(session, row.name, policy, await place.steps())
    aliased = await session.get(ModelAliasRow, (row.name, alias))
    return None if aliased is None else aliased.step


# -- retention ------------------------------------------------------------------------------


def _policy_wire(row: RetentionPolicyRow, best: int | None) -> RetentionPolicy:
    return RetentionPolicy(
        model=row.model_name,
        keep_last=row.keep_last,
        keep_best_by=row.keep_best_by,
        higher_is_better=row.higher_is_better,
        best_step=best,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


async def get_retention(session: AsyncSession, backends: Backends, *, name: str) -> RetentionPolicy:
    """The model's policy; without one, the default: every checkpoint is kept."""
    _, on_disk = await _locate(session, backends, name)
    policy = await _policy(session, name)
    if policy is None:
        return RetentionPolicy(
            model=name,
            keep_last=None,
            keep_best_by=None,
            higher_is_better=True,
            best_step=None,
            created_at=None,
            updated_at=None,
        )
    return _policy_wire(policy, await best_step(session, name, policy, on_disk))


async def set_retention(
    session: AsyncSession, backends: Backends, *, name: str, body: RetentionPolicyIn
) -> tuple[RetentionPolicy, bool]:
    """Store the policy (it applies after the next step, or on demand)."""
    _, on_disk = await _locate(session, backends, name, lock=True)
    policy = await _policy(session, name)
    created = policy is None
    if policy is None:
        policy = RetentionPolicyRow(model_name=name)
        session.add(policy)
    policy.keep_last = body.keep_last
    policy.keep_best_by = body.keep_best_by
    policy.higher_is_better = body.higher_is_better
    await session.flush()
    _has_policy.pop(name, None)
    await session.refresh(policy)
    return _policy_wire(policy, await best_step(session, name, policy, on_disk)), created


async def delete_retention(session: AsyncSession, *, name: str) -> None:
    """Back to the default (every checkpoint kept); idempotent."""
    await _model(session, name, lock=True)
    policy = await _policy(session, name)
    if policy is not None:
        await session.delete(policy)
        await session.flush()
    _has_policy.pop(name, None)


async def apply_retention(session: AsyncSession, backends: Backends, *, name: str) -> RetentionRun:
    """Delete every checkpoint the policy does not keep: kept are the newest `keep_last`
    and every protected step (the latest, aliased ones, `best`, those jobs need). Without
    a policy every checkpoint is kept."""
    place, on_disk = await _locate(session, backends, name, lock=True)
    policy = await _policy(session, name)
    if policy is None:
        return RetentionRun(kept=sorted(on_disk), deleted=[])
    keep = set(sorted(on_disk)[-policy.keep_last :])
    keep |= set(await protected(session, place.row, on_disk))
    doomed = sorted(set(on_disk) - keep)
    if doomed:
        await _delete(place, on_disk, doomed)
    left = await place.steps()
    return RetentionRun(kept=sorted(left), deleted=[s for s in doomed if s not in left])


async def retain_after_step(engine: AsyncEngine, backends: Backends, name: str) -> None:
    """Apply the model's retention policy, if it has one, after a step succeeded. Never
    raises: the step stands whatever happens here (the next step, or a call on demand,
    tries again)."""
    try:
        if not await _with_policy(engine, name):
            return
        async with AsyncSession(engine, expire_on_commit=False, autoflush=False) as session:
            run = await apply_retention(session, backends, name=name)
            await session.commit()
        if run.deleted:
            log.info("model %s: retention deleted steps %s", name, run.deleted)
    except Exception as exc:
        log.warning("model %s: retention failed: %s", name, exc)


async def _with_policy(engine: AsyncEngine, name: str) -> bool:
    now = asyncio.get_running_loop().time()
    known = _has_policy.get(name)
    if known is not None and known[0] > now:
        return known[1]
    async with engine.connect() as conn:
        query = select(RetentionPolicyRow.model_name).where(RetentionPolicyRow.model_name == name)
        found = (await conn.execute(query)).first() is not None
    _has_policy[name] = (now + POLICY_TTL_SECONDS, found)
    return found


# -- export ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Export:
    filename: str
    chunks: Iterator[bytes]
    size: int | None = None  # known up front: the merged tar's


async def export(
    session: AsyncSession,
    backends: Backends,
    *,
    name: str,
    step: int,
    fmt: ExportFormat,
    model_roots: Sequence[Path],
) -> Export:
    """The step's adapter (adapter_config.json + adapter_model.safetensors, no optimizer
    state) in a `{name}-step{NNNN}/` folder of a tar.gz (also named `peft`) or zip archive;
    `merged`: the base model with the adapter merged in, a Hugging Face directory
    `{name}-step{NNNN}-merged/` in a tar (`app.checkpoints.merge`; the base must be under
    `model_roots`)."""
    place, on_disk = await _locate(session, backends, name)
    if step not in on_disk:
        raise _missing_step(name, step)
    local = await place.local(step, on_disk[step])
    if local is None:  # deleted meanwhile
        raise _missing_step(name, step)
    files = await asyncio.to_thread(disk.open_adapter, local)
    if files is None:
        raise NoAdapterError(
            f"step {step} of {name!r} holds no adapter ({' + '.join(disk.ADAPTER_FILES)}): "
            "its backend saves none (dry-run trains no weights)",
            errors=[_error("path", "step", "no adapter in this checkpoint", "no_adapter")],
        )
    folder = f"{name}-step{step:04d}"
    if fmt == "merged":
        for _, handle in files:
            handle.close()
        return await _merged(place, local, folder, model_roots)
    suffix = "tar.gz" if fmt == "peft" else fmt
    archive = await asyncio.to_thread(disk.archive, folder, files, suffix)
    return Export(f"{folder}.{suffix}", disk.chunks(archive))


async def _merged(place: Place, local: Path, folder: str, roots: Sequence[Path]) -> Export:
    base = place.spec.base_model
    refusal = base_model_refusal(base, roots)
    if refusal is None and not await asyncio.to_thread(Path(base).is_dir):
        refusal = "is not a directory"
    if refusal is not None:
        raise BaseNotLocalError(
            f"the base model {base!r} of {place.row.name!r} ({place.row.backend}) is not a local "
            f"directory this server may read: it {refusal}. A merge needs the base's weights "
            "here; `format=tar.gz` exports the adapter alone",
            errors=[_error("query", "format", "the base model is not local", "base_not_local")],
        )
    folder = f"{folder}-merged"
    try:
        planned = await asyncio.to_thread(
            merge.plan, base=Path(base), adapter_dir=local, folder=folder, roots=roots
        )
    except merge.Refusal as exc:
        kind = BaseNotLocalError if exc.kind == "base-not-local" else NotMergeableError
        raise kind(
            f"step {local.name} of {place.row.name!r} cannot be merged into its base: {exc}",
            errors=[_error("query", "format", str(exc), exc.kind.replace("-", "_"))],
        ) from exc
    return Export(f"{folder}.tar", planned.chunks(), planned.size)
