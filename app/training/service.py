"""Training jobs: accept and show. Workers take it from there (`app.training.runner`)."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.backends import SPECS
from app.datasets import decode_splits
from app.db import begin_write
from app.errors import ConflictError, InvalidInputError, field_errors, format_path
from app.ingest import jsontext
from app.jobs.exclusive import ensure_no_run
from app.jobs.lifecycle import JobKind, JobStatus
from app.jobs.payloads import Payload
from app.jobs.service import JobView, enqueue_once, get_job, job_fields, replay
from app.jobs.store import new_job
from app.jobs.usage import Pricing
from app.models import DatasetRow, JobRow, ModelRow
from app.schemas.common import FieldError
from app.schemas.jobs import (
    TRAINING_PIECES,
    JobResult,
    TrainingJob,
    TrainingJobCreate,
    TrainingTrajectories,
    TrajectoryShape,
)
from app.schemas.pieces import validate_item
from app.schemas.supervised import (
    MAX_EXAMPLES,
    DatasetSource,
    DpoJobCreate,
    DpoSummary,
    SftExample,
    SftJobCreate,
    SftSummary,
)
from app.schemas.trajectories import ArtTrajectoryGroup, TrajectoryCollection, TrajectorySummary
from app.settings import Settings
from app.training import methods, spec
from app.trajectories import (
    MAX_ISSUES,
    Loc,
    art_group_issues,
    check_collection,
    check_groups,
    groups_to_collection,
    nat_group_issues,
    nat_group_to_art,
    summarize_collection,
    summarize_groups,
    summarize_rewards,
)

# Stored specs above this are read back in a thread, so the event loop keeps serving.
_THREAD_BYTES = 1 << 20


def _invalid(detail: str, errors: list[dict[str, Any]]) -> InvalidInputError:
    return InvalidInputError(detail, errors=field_errors(errors))


def hyperparameters_of(
    backend: str,
    hyperparameters: dict[str, Any],
    *,
    loc: tuple[str, ...] = ("hyperparameters",),
    method: str = "rl",
    method_loc: tuple[str, ...] = ("method",),
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The backend's hyper-parameters for `method`, validated once and normalized (only
    those set), or the errors at `loc` (at `method` when the backend does not train so)."""
    accepted = SPECS[backend].method_hyperparameters(method)
    if accepted is None:
        offered = ", ".join(SPECS[backend].methods())
        message = f"backend `{backend}` does not train with `{method}` (it offers: {offered})"
        reason = SPECS[backend].refusals.get(method)
        return {}, [
            {
                "loc": method_loc,
                "msg": f"{message}; {reason}" if reason else message,
                "type": "unsupported_method",
            }
        ]
    try:
        parsed = accepted.model_validate(hyperparameters, strict=True)  # "0.1" is no number
    except ValidationError as exc:
        return {}, [{**e, "loc": (*loc, *e["loc"])} for e in exc.errors()]
    return parsed.model_dump(mode="json", exclude_unset=True), []


def check_trajectories(
    body: TrainingJobCreate,
) -> tuple[TrajectorySummary, list[dict[str, Any]]]:
    opt_out = body.hyperparameters.get("allow_training_without_logprobs") is True
    if body.collection is not None:
        prefix: tuple[str, ...] = ("collection",)
        issues = check_collection(body.collection, require_logprobs=not opt_out)
        summary = summarize_collection(body.collection)
    else:
        assert body.groups is not None
        prefix = ("groups",)
        issues = check_groups(body.groups, require_logprobs=not opt_out)
        summary = summarize_groups(body.groups)
    errors = [{"loc": (*prefix, *i.loc), "msg": i.msg, "type": i.type} for i in issues]
    return summary, errors


@dataclass(frozen=True)
class Prepared:
    """What a training job keeps of its request, read and checked off the event loop."""

    model: str
    hyperparameters: dict[str, Any]
    metadata: dict[str, Any]
    policy_step: int | None
    max_steps_off_policy: int | None
    summary: BaseModel  # TrajectorySummary (rl), SftSummary, DpoSummary
    errors: list[dict[str, Any]]  # the trajectories' problems
    payload: Payload | None  # the spec, when there are none (or the examples are a dataset's)
    request_hash: str
    method: str = "rl"
    dataset: DatasetSource | None = None  # SFT examples still to read from a dataset


def prepare_sft(body: SftJobCreate, raw: bytes, settings: Settings) -> Prepared:
    """An SFT request: inline examples encoded now; a dataset's read when it is stored."""
    payload, summary = None, SftSummary(num_examples=0, num_target_turns=0)
    if body.examples is not None:
        payload, summary = methods.encode_sft([methods.example_json(e) for e in body.examples])
    return Prepared(
        model=body.model,
        hyperparameters=body.hyperparameters,
        metadata=body.metadata,
        policy_step=None,
        max_steps_off_policy=None,
        summary=summary,
        errors=[],
        payload=payload,
        request_hash=hashlib.sha256(raw).hexdigest(),
        method="sft",
        dataset=body.dataset,
    )


def prepare_dpo(body: DpoJobCreate, raw: bytes, settings: Settings) -> Prepared:
    errors = methods.dpo_problems(body)
    payload, summary = methods.encode_dpo([] if errors else methods.pairs_of(body))
    return Prepared(
        model=body.model,
        hyperparameters=body.hyperparameters,
        metadata=body.metadata,
        policy_step=None,
        max_steps_off_policy=None,
        summary=summary,
        errors=errors,
        payload=None if errors else payload,
        request_hash=hashlib.sha256(raw).hexdigest(),
        method="dpo",
    )


async def _dataset_examples(
    session: AsyncSession, source: DatasetSource
) -> tuple[Payload | None, SftSummary | None, list[dict[str, Any]]]:
    """The SFT examples of a dataset's split, encoded; or the errors naming `dataset`."""
    row = (
        await session.execute(
            select(DatasetRow.payload, DatasetRow.payload_bytes).where(DatasetRow.id == source.id)
        )
    ).one_or_none()
    if row is None:
        return None, None, [_error(("dataset", "id"), "no such dataset", "unknown_dataset")]
    splits = await decode_splits(row.payload, row.payload_bytes)
    lines = splits.get(source.split)
    if not lines:
        known = ", ".join(sorted(splits))
        message = f"dataset {source.id} has no examples in split {source.split!r} (it has: {known})"
        return None, None, [_error(("dataset", "split"), message, "unknown_split")]
    if len(lines) > MAX_EXAMPLES:
        message = (
            f"split {source.split!r} holds {len(lines)} examples; an SFT job trains on at "
            f"most {MAX_EXAMPLES} (one model step)"
        )
        return None, None, [_error(("dataset", "split"), message, "too_long")]
    examples, errors = [], []
    for line in lines:
        try:
            example = SftExample.model_validate(
                {"messages": line.get("messages"), "tools": line.get("tools")}
            )
        except ValidationError as exc:
            detail = exc.errors()[0]["msg"]
            message = f"example {line.get('id')!r} cannot be trained on: {detail}"
            errors.append(_error(("dataset",), message, "unusable_example"))
            if len(errors) >= MAX_ISSUES:
                break
            continue
        examples.append(methods.example_json(example))
    if errors:
        return None, None, errors
    payload, summary = methods.encode_sft(examples, dataset=source.id)
    return payload, summary, []


def _error(loc: tuple[str | int, ...], msg: str, kind: str) -> dict[str, Any]:
    return {"loc": loc, "msg": msg, "type": kind}


def prepare(body: TrainingJobCreate, raw: bytes, settings: Settings) -> Prepared:
    """Check the trajectories and encode the spec (in a thread for a large body)."""
    summary, errors = check_trajectories(body)
    payload = None if errors else spec.encode(spec.groups_of(body))
    return _prepared(body, raw, summary, errors, payload)


def _prepared(
    body: TrainingJobCreate,
    raw: bytes,
    summary: TrajectorySummary,
    errors: list[dict[str, Any]],
    payload: Payload | None,
) -> Prepared:
    return Prepared(
        model=body.model,
        hyperparameters=body.hyperparameters,
        metadata=body.metadata,
        policy_step=body.policy_step,
        max_steps_off_policy=body.max_steps_off_policy,
        summary=summary,
        errors=errors,
        payload=payload,
        request_hash=hashlib.sha256(raw).hexdigest(),
    )


class StreamedGroups:
    """A large training body read a group at a time, as the parser reaches each group
    (`app.ingest.jsontext` streams, `Reading.stream`): the group is checked against the limits,
    validated, checked, converted and added to the compressed spec, then let go, so the
    body's groups never exist all at once (parsed whole, a 23 MB collection held about
    106 MB of objects, validated another copy).

    It reads only bodies with nothing to report: at the first problem of any kind (a
    limit, a field, a check, a job that trains without logprobs) it gives up
    (`Unstreamable`), and the body is read whole, which reports every problem in order.
    The body's own fields are validated with the streamed list left empty: neither
    `TrainingJobCreate` nor `TrajectoryCollection` constrains the list itself."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.over = _Limits(settings)
        self.rewards: list[list[float]] = []
        self.source: str | None = None
        self.spec = spec.Encoding()

    @property
    def streams(self) -> jsontext.Streams:
        return {("groups",): self._art_group, ("collection", "trajectories"): self._nat_group}

    def _art_group(self, item: Any) -> None:
        g = self._next("groups")
        self.over.art_group(g, item)
        self._within_limits()
        group = validate_item(item, ("groups",), TRAINING_PIECES)
        if group is None or next(art_group_issues(g, group, True), None) is not None:
            raise jsontext.Unstreamable(f"groups[{g}] has a problem to report")
        self._add([t.reward for t in group.trajectories], spec.group_json(group))

    def _nat_group(self, item: Any) -> None:
        g = self._next("collection")
        self.over.nat_group(g, item)
        self._within_limits()
        group = validate_item(item, ("collection", "trajectories"), TRAINING_PIECES)
        if group is None or next(nat_group_issues(g, group, True), None) is not None:
            raise jsontext.Unstreamable(f"collection.trajectories[{g}] has a problem to report")
        self._add([t.reward for t in group], nat_group_to_art(group))

    def _next(self, source: str) -> int:
        if self.source not in (None, source):
            raise jsontext.Unstreamable("both `groups` and `collection`")
        self.source = source
        if len(self.rewards) >= self.settings.max_groups_per_job:
            raise jsontext.Unstreamable("too many groups")
        return len(self.rewards)

    def _within_limits(self) -> None:
        if self.over.errors or self.over.too_many_tokens():
            raise jsontext.Unstreamable("a limit is exceeded")

    def _add(self, rewards: list[float], group: dict[str, Any]) -> None:
        self.spec.add(group)
        self.rewards.append(rewards)

    def finish(self, body: TrainingJobCreate, raw: bytes) -> Prepared | None:
        """What `prepare` makes of the whole body; None if it must be read whole."""
        if not self.rewards or body.hyperparameters.get("allow_training_without_logprobs") is True:
            return None  # no groups to report; checks that differ without logprobs
        return _prepared(body, raw, summarize_rewards(self.rewards), [], self.spec.finish())


def limits(data: Any, settings: Settings) -> list[FieldError]:
    """What in a parsed request (not yet validated) passes the service's limits on groups,
    trajectories, items and logprob entries: each as a FieldError naming its setting."""
    over = _Limits(settings)
    if not isinstance(data, dict):
        return []
    groups, collection = data.get("groups"), data.get("collection")
    if isinstance(groups, list):
        over.count(("groups",), groups, "groups", settings.max_groups_per_job)
        for g, group in enumerate(groups):
            over.art_group(g, group)
    if isinstance(collection, dict):
        groups = collection.get("trajectories")
        over.count(("collection", "trajectories"), groups, "groups", settings.max_groups_per_job)
        for g, group in enumerate(_list(groups)):
            over.nat_group(g, group)
    if over.too_many_tokens():
        over.errors.append(
            FieldError(
                location="body",
                path="",
                message=f"{over.tokens} logprob entries; at most "
                f"{settings.max_logprob_tokens_per_job} per job "
                "(TRAINYARD_MAX_LOGPROB_TOKENS_PER_JOB)",
                type="too_many_logprobs",
            )
        )
    return over.errors[:MAX_ISSUES]


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


class _Limits:
    _SETTINGS = {
        "groups": ("max_groups_per_job", "per job"),
        "trajectories": ("max_trajectories_per_group", "per group"),
        "items": ("max_items_per_trajectory", "per trajectory"),
        "tools": ("max_items_per_trajectory", "per trajectory"),
    }

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.errors: list[FieldError] = []
        self.tokens = 0

    def count(self, loc: Loc, value: Any, what: str, limit: int | None = None) -> None:
        setting, per = self._SETTINGS[what]
        limit = limit if limit is not None else getattr(self.settings, setting)
        if isinstance(value, list) and len(value) > limit:
            self.errors.append(
                FieldError(
                    location="body",
                    path=format_path(loc),
                    message=f"{len(value)} {what}; at most {limit} {per} "
                    f"(TRAINYARD_{setting.upper()})",
                    type=f"too_many_{what}",
                )
            )

    def art_group(self, g: int, group: Any) -> None:
        """The limits of `groups[g]` (parsed, not yet validated)."""
        trajectories = group.get("trajectories") if isinstance(group, dict) else None
        self.count(("groups", g, "trajectories"), trajectories, "trajectories")
        for t, trajectory in enumerate(_list(trajectories)):
            if isinstance(trajectory, dict):
                at: Loc = ("groups", g, "trajectories", t)
                items = trajectory.get("messages_and_choices")
                self.count((*at, "messages_and_choices"), items, "items")
                self.count((*at, "tools"), trajectory.get("tools"), "tools")
                self.tokens_of(items)

    def nat_group(self, g: int, group: Any) -> None:
        """The limits of `collection.trajectories[g]` (parsed, not yet validated)."""
        self.count(("collection", "trajectories", g), group, "trajectories")
        for t, trajectory in enumerate(_list(group)):
            if isinstance(trajectory, dict):
                episode = trajectory.get("episode")
                self.count(("collection", "trajectories", g, t, "episode"), episode, "items")
                self.tokens_of(episode)

    def too_many_tokens(self) -> bool:
        return self.tokens > self.settings.max_logprob_tokens_per_job

    def tokens_of(self, items: Any) -> None:
        """Count the logprob entries of a trajectory's items (any that carry them)."""
        for item in _list(items):
            logprobs = item.get("logprobs") if isinstance(item, dict) else None
            if not isinstance(logprobs, dict):
                continue
            for key in ("content", "refusal"):
                for entry in _list(logprobs.get(key)):
                    self.tokens += 1
                    if isinstance(entry, dict):
                        self.tokens += len(_list(entry.get("top_logprobs")))


async def create_training_job(
    session: AsyncSession,
    *,
    job: Prepared,
    idempotency_key: str | None,
    max_attempts: int,
    project_id: str | None = None,
    key_id: str | None = None,
) -> tuple[JobRow, bool]:
    """Store a prepared job with its spec and first event. Returns (job, replayed).
    `project_id`: the model must be that project's (another's is no such model).

    Every problem with the request is reported at once (422); nothing is stored then.
    """
    errors = list(job.errors)
    await begin_write(session)
    if idempotency_key is not None:
        earlier = await replay(session, idempotency_key, job.request_hash)
        if earlier is not None:
            return earlier, True
    model = await session.get(ModelRow, job.model)
    if model is not None and project_id is not None and model.project_id != project_id:
        model = None  # another project's: as if there were none
    hyperparameters: dict[str, Any] = {}
    if model is None:
        errors.insert(
            0,
            {
                "loc": ("model",),
                "msg": "no such model; create it with POST /v1/models",
                "type": "unknown_model",
            },
        )
    else:
        hyperparameters, bad = hyperparameters_of(
            model.backend, job.hyperparameters, method=job.method
        )
        errors += bad
    payload, summary = job.payload, job.summary
    if job.dataset is not None:
        payload, read, bad = await _dataset_examples(session, job.dataset)
        summary = read or summary
        errors += bad
    if errors:
        raise _invalid(f"{len(errors)} problem(s) in the request; nothing was stored", errors)
    assert model is not None and payload is not None
    await ensure_no_run(session, model.name, what="a training job")
    new = new_job(
        JobKind.training,
        model=model.name,
        payload=payload,
        hyperparameters=hyperparameters,
        metadata=job.metadata,
        summary=summary.model_dump(),
        request_hash=job.request_hash,
        max_attempts=max_attempts,
        idempotency_key=idempotency_key,
        policy_step=job.policy_step,
        max_steps_off_policy=job.max_steps_off_policy,
    )
    return await enqueue_once(session, new, idempotency_key, key_id)


async def trajectories(
    session: AsyncSession, job_id: str, *, shape: TrajectoryShape
) -> TrainingTrajectories | TrajectoryCollection:
    """What a training job was given, as it stores it (ART-style groups; a NAT collection
    was converted on arrival), in ART's shape or as a NAT `TrajectoryCollection`."""
    job = await get_job(session, job_id, kind=JobKind.training)
    method = methods.method_of(job.payload_format)
    if method != "rl":
        raise ConflictError(
            f"training job {job_id} is a `{method}` job: it was given "
            f"{'examples' if method == 'sft' else 'preference pairs'}, not trajectories"
        )
    await session.refresh(job, ["payload"])
    payload = Payload(job.payload_format, job.payload, job.payload_bytes)
    if payload.size > _THREAD_BYTES:
        return await asyncio.to_thread(_shaped, payload, shape, job.id)
    return _shaped(payload, shape, job.id)


def _shaped(
    payload: Payload, shape: TrajectoryShape, job_id: str
) -> TrainingTrajectories | TrajectoryCollection:
    groups = [ArtTrajectoryGroup.model_validate(g) for g in spec.stored_groups(payload)]
    if shape == "nat":
        return groups_to_collection(groups, run_id=job_id)
    return TrainingTrajectories(groups=groups)


def to_wire(job: JobView, pricing: Pricing) -> TrainingJob:
    result = None
    if job.status == JobStatus.succeeded.value:
        result = JobResult(
            start_step=job.start_step,
            final_step=job.final_step,
            checkpoint_path=job.checkpoint_path,
            metrics=job.metrics,
            recovered=job.recovered,
            trained=job.trained,
            reason=_untrained_reason(job) if job.trained is False else None,
        )
    method = job.summary.get("method", "rl")
    return TrainingJob(
        **job_fields(job, pricing),
        method=method,
        summary=_SUMMARIES.get(method, TrajectorySummary).model_validate(job.summary),
        hyperparameters=job.hyperparameters,
        policy_step=job.policy_step,
        max_steps_off_policy=job.max_steps_off_policy,
        result=result,
    )


_SUMMARIES: dict[str, type[BaseModel]] = {"sft": SftSummary, "dpo": DpoSummary}


def _untrained_reason(job: JobView) -> str:
    if job.summary.get("num_trainable_groups") == 0:
        return (
            "no group was trainable (each had one trajectory or equal rewards: GRPO learns "
            "nothing from them); the step counted without changing the weights"
        )
    return "the backend found nothing to train on; the step counted without changing the weights"
