"""Run one claimed rollout job: sample (or call the agent), grade, group per example, and
optionally enqueue a training job with the groups, in the same final write.

Sampling and grading failures of single answers are recorded and skipped, and so is an
answer (the agent's trajectory, or the endpoint's choice) that training would refuse: each
is checked like training input as it arrives. The job fails only when the model's endpoint
itself stays unreachable, or nothing at all came back. Calls to agents and webhook graders
go through `app.egress`; what a job records of their failures is a status and a length,
never what they answered.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from app.backends.base import BackendError, Inference, classify
from app.egress import EgressClient, EgressError, EgressPolicy, Reply
from app.errors import format_path
from app.evaluations import scoring
from app.jobs.lifecycle import (
    Cancelled,
    ErrorInfo,
    EventType,
    Failed,
    JobUpdate,
    Outcome,
    Succeeded,
)
from app.jobs.payloads import compress
from app.jobs.store import Claim, LeaseState
from app.jobs.supervise import (
    KindRunner,
    Progress,
    RunContext,
    failure,
    gone,
    started_event,
    supervise,
    with_used,
)
from app.rollouts import spec
from app.rollouts.graders import Grader
from app.rollouts.sampling import SamplingClient, SamplingError, tokens_of
from app.rollouts.service import training_child
from app.rollouts.spec import RolloutSpec
from app.schemas.rollouts import Example
from app.schemas.trajectories import (
    ArtTrajectory,
    ArtTrajectoryGroup,
    NatTrajectory,
    TrajectoryCollection,
)
from app.settings import Settings
from app.trajectories import TrajectoryIssue, check_collection, check_groups, collection_to_groups

log = logging.getLogger(__name__)
MAX_ERRORS_KEPT = 20
MAX_ERROR_CHARS = 500
# Agent answers longer than this are parsed and checked in a thread.
THREAD_BYTES = 1 << 20


@dataclass
class Collected:
    groups: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    num_errors: int = 0
    untrainable: list[str | int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def error(self, message: str) -> None:
        self.num_errors += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            if len(message) > MAX_ERROR_CHARS:
                message = message[: MAX_ERROR_CHARS - 3] + "..."
            self.errors.append(message)

    def stats(self) -> dict[str, Any]:
        # A run's validation score is `mean_reward`: summed up as an evaluation's scores are.
        summed = scoring.stats(self.rewards)
        return {
            "num_graded": summed.count,
            "num_groups": len(self.groups),
            "num_errors": self.num_errors,
            "mean_reward": summed.mean,
            "reward_std": summed.std,
            "untrainable_groups": self.untrainable,
            "errors": self.errors,
        }

    def tokens(self) -> JobUpdate:
        """The job's columns of tokens sampled (agents sample through their own calls:
        those count where they are made, e.g. the gateway)."""
        return JobUpdate(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)


async def run(claim: Claim, ctx: RunContext) -> None:
    lease, store = claim.lease, ctx.store
    try:
        try:
            recipe = spec.decode(claim.payload)
        except ValidationError as exc:  # e.g. stored before a check was added: never quote it
            message = f"the stored spec is not valid: {_validation_text(exc, root=None)}"
            raise BackendError(message, transient=False) from None
        adapter = ctx.backends.get(claim.backend)
        inference = await adapter.inference(claim.model)
        api_key = (await adapter.model(claim.model)).inference_api_key
        if not inference.base_url:
            raise BackendError(f"backend {claim.backend!r} serves no endpoint", transient=False)
    except Exception as exc:
        await ctx.apply(lease, failure(classify(exc), claim, ctx.settings))
        ctx.signal()
        return
    total = len(recipe.examples) * recipe.num_generations
    # The step it samples: the policy version of every trajectory it builds.
    started = started_event(
        lease, inference.step, {"model": inference.model_name, "samples": total}
    )
    if not await store.record_start(lease, start_step=inference.step, event=started):
        return
    ctx.signal()
    progress = Progress(EventType.rollout_progress, coalesce=True)
    # Held here, not only by the work: an attempt cancelled or failed part of the way
    # through still counts the tokens it sampled.
    collected = Collected()
    work = asyncio.create_task(
        _collect(recipe, inference, api_key, progress, ctx.settings, collected),
        name=f"rollout:{lease.job_id}",
    )
    try:
        outcome = await _outcome(claim, recipe, work, progress, ctx, inference.step)
        outcome = with_used(outcome, collected.tokens())
    finally:
        if not work.done():
            work.cancel()
    if outcome is not None:
        await ctx.apply(lease, outcome, earlier=progress.take())
    ctx.signal()


async def _outcome(
    claim: Claim,
    recipe: RolloutSpec,
    work: asyncio.Task[Collected],
    progress: Progress,
    ctx: RunContext,
    sampled_step: int,
) -> Outcome | None:
    try:
        supervised = await supervise(work, claim.lease, progress, ctx)
    except SamplingError as exc:
        return failure(BackendError(str(exc), transient=exc.transient), claim, ctx.settings)
    except Exception as exc:
        return failure(classify(exc), claim, ctx.settings)
    if supervised == "lost":
        return None
    if supervised == "cancelled":
        return Cancelled("running", {"samples": progress.step})
    try:
        return _collected(claim, recipe, work.result(), progress, ctx, sampled_step)
    except Exception as exc:  # a job whose worker caught its error ends now, not by lease
        log.exception("rollout %s: building its result failed", claim.lease.job_id)
        return failure(classify(exc), claim, ctx.settings)


def _collected(
    claim: Claim,
    recipe: RolloutSpec,
    collected: Collected,
    progress: Progress,
    ctx: RunContext,
    sampled_step: int,
) -> Outcome:
    """`sampled_step`: the model step every answer was sampled from (the policy version
    the training job it enqueues is tagged with)."""
    stats = collected.stats()
    if not collected.groups:
        message = "no answer could be sampled and graded: " + "; ".join(collected.errors[:3])
        error = ErrorInfo(type="NothingCollected", message=message, transient=False)
        return Failed(error, data=stats, job={"metrics": stats, **collected.tokens()})
    child = None
    if recipe.train is not None:
        try:
            child = training_child(
                claim.model.name,
                collected.groups,
                recipe.train.hyperparameters,
                parent=claim.lease.job_id,
                max_attempts=ctx.settings.max_attempts,
                policy_step=sampled_step,
                max_steps_off_policy=recipe.train.max_steps_off_policy,
                job_id=recipe.train_job_id,
                labels=recipe.train_metadata,
            )
        except ValueError as exc:
            error = ErrorInfo(type="UntrainableGroups", message=str(exc), transient=False)
            return Failed(error, data=stats, job={"metrics": stats, **collected.tokens()})
    output = json.dumps(collected.groups).encode()
    child_id = child.id if child is not None else None
    return Succeeded(
        {**stats, "groups": len(collected.groups), "training_job_id": child_id},
        job={
            "output": compress(output),
            "output_bytes": len(output),
            "metrics": stats,
            "next_job_id": child_id,
            "progress_step": progress.step,
            "progress_total": progress.total,
            **collected.tokens(),
        },
        child=child,
    )


async def settle(state: LeaseState, ctx: RunContext, reason: ErrorInfo) -> Outcome:
    """A rollout whose worker is gone: cancelled if asked, else retried or failed. A
    rollout trains nothing, so there is no landed step to count."""
    if state.cancel_requested:
        return Cancelled("recovering")
    return gone(reason, state, ctx.settings)


RUNNER = KindRunner(run=run, settle=settle)


async def _collect(
    body: RolloutSpec,
    inference: Inference,
    api_key: str | None,
    progress: Progress,
    settings: Settings,
    collected: Collected,
) -> Collected:
    total = len(body.examples) * body.num_generations
    done = 0
    require_logprobs = _require_logprobs(body)

    def advance(count: int) -> None:
        nonlocal done
        done += count
        mean = sum(collected.rewards) / len(collected.rewards) if collected.rewards else 0.0
        progress(done, total, {"mean_reward": mean, "errors": collected.num_errors})

    policy = EgressPolicy.from_settings(settings)
    async with EgressClient(policy, max_connections=body.concurrency) as egress:
        if body.agent is not None:
            agent = _AgentCalls(
                body,
                inference,
                api_key,
                egress,
                asyncio.Semaphore(body.concurrency),
                settings.agent_max_response_bytes,
                require_logprobs,
            )
            results = await asyncio.gather(
                *(agent.example(example, collected, advance) for example in body.examples)
            )
        else:
            grading = asyncio.Semaphore(body.concurrency)  # webhook graders are services too
            async with SamplingClient(
                inference.base_url or "", api_key, concurrency=body.concurrency, timeout=600
            ) as sampler:
                results = await asyncio.gather(
                    *(
                        _sample_example(
                            body,
                            example,
                            inference,
                            sampler,
                            egress,
                            grading,
                            collected,
                            advance,
                            require_logprobs,
                        )
                        for example in body.examples
                    )
                )
    for example, trajectories in zip(body.examples, results, strict=True):
        if not trajectories:
            continue
        if len({t["reward"] for t in trajectories}) < 2:
            collected.untrainable.append(example.id)
        collected.groups.append(
            {"trajectories": trajectories, "metadata": {"example_id": str(example.id)}}
        )
    return collected


def _require_logprobs(body: RolloutSpec) -> bool:
    """Whether built trajectories need logprobs: when they are to be trained on, unless the
    training opts out (as a training job's own check reads it)."""
    if body.train is None:
        return False
    return body.train.hyperparameters.get("allow_training_without_logprobs") is not True


class _Refused(Exception):
    """An answer that cannot be kept; the message is safe to record (no remote text)."""


def _issue_text(issue: TrajectoryIssue, skip: int) -> str:
    path = format_path(("trajectory", *issue.loc[skip:]))
    return f"{issue.type} at {path}"


def _validation_text(exc: ValidationError, root: str | None = "trajectory") -> str:
    """The first problem pydantic found: its kind, path and message, never the input."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    first = errors[0]
    loc = (root, *first["loc"]) if root else first["loc"]
    text = f"{first['type']} at {format_path(loc)}"
    if first["type"] not in ("value_error", "assertion_error"):  # only pydantic's own words
        text += f" ({first['msg']})"
    return text


def _check(trajectory: ArtTrajectory, require_logprobs: bool) -> None:
    """Raises `_Refused` when training would refuse this trajectory."""
    group = ArtTrajectoryGroup(trajectories=[trajectory])
    issues = check_groups([group], require_logprobs=require_logprobs)
    if issues:
        more = f" (and {len(issues) - 1} more)" if len(issues) > 1 else ""
        raise _Refused(f"cannot be trained on: {_issue_text(issues[0], 3)}{more}")


async def _sample_example(
    body: RolloutSpec,
    example: Example,
    inference: Inference,
    sampler: SamplingClient,
    egress: EgressClient,
    grading: asyncio.Semaphore,
    collected: Collected,
    advance: Callable[[int], None],
    require_logprobs: bool,
) -> list[dict[str, Any]]:
    request: dict[str, Any] = {
        "model": inference.model_name,
        "messages": example.messages,
        "n": body.num_generations,
        "logprobs": True,
        **body.sampling.model_dump(exclude_none=True),
    }
    try:
        response = await sampler.chat(request)
    except SamplingError as exc:
        if exc.transient:
            raise  # the endpoint is away: retry the whole job later
        collected.error(f"example {example.id}: {exc}")
        advance(body.num_generations)
        return []
    prompt, completion = tokens_of(response)
    collected.prompt_tokens += prompt
    collected.completion_tokens += completion
    assert body.grader is not None
    example_json = example.model_dump(mode="json")
    trajectories = []
    for generation, choice in enumerate(response.get("choices", [])):
        where = f"example {example.id} generation {generation}"
        try:
            kept = await _graded(
                body.grader,
                body,
                example,
                example_json,
                generation,
                choice,
                egress,
                grading,
                require_logprobs,
            )
        except _Refused as exc:
            collected.error(f"{where}: {exc}")
        except Exception as exc:  # one answer never sinks the job
            log.exception("rollout: %s could not be graded", where)
            collected.error(f"{where}: could not be graded: {type(exc).__name__}")
        else:
            collected.rewards.append(kept["reward"])
            trajectories.append(kept)
        advance(1)
    return trajectories


async def _graded(
    grader: Grader,
    body: RolloutSpec,
    example: Example,
    example_json: dict[str, Any],
    generation: int,
    choice: Any,
    egress: EgressClient,
    grading: asyncio.Semaphore,
    require_logprobs: bool,
) -> dict[str, Any]:
    """One sampled answer, checked as training input, then graded; `_Refused` if not kept
    (checked first: an answer training would refuse costs no grading call)."""
    try:
        answer = scoring.answer_of(choice)
    except scoring.Unscorable as exc:
        raise _Refused(str(exc)) from None
    metadata: dict[str, Any] = {"example_id": str(example.id), "generation": generation}
    trajectory = {
        "messages_and_choices": [*example.messages, choice],
        "tools": body.sampling.tools,
        "reward": 0.0,  # until graded
        "metadata": metadata,
    }
    try:
        checked = ArtTrajectory.model_validate(trajectory)
    except ValidationError as exc:
        raise _Refused(f"the endpoint's answer is not valid: {_validation_text(exc)}") from None
    try:
        _check(checked, require_logprobs)
    except _Refused as exc:
        raise _Refused(f"the endpoint's answer {exc}") from None
    async with grading:
        result = await scoring.score(
            grader, example=example_json, answer=answer, generation=generation, client=egress
        )
    if result.reward is None:
        raise _Refused(str(result.error))
    if result.reasoning:
        metadata["reasoning"] = result.reasoning[:2000]
    trajectory["reward"] = result.reward
    return trajectory


@dataclass
class _AgentCalls:
    """Calls the agent service per example and generation; keeps what training accepts."""

    body: RolloutSpec
    inference: Inference
    api_key: str | None
    egress: EgressClient
    calls: asyncio.Semaphore
    max_bytes: int
    require_logprobs: bool

    async def example(
        self, example: Example, collected: Collected, advance: Callable[[int], None]
    ) -> list[dict[str, Any]]:
        async def one(generation: int) -> dict[str, Any] | None:
            where = f"example {example.id} generation {generation}"
            try:
                return await self.call(example, generation)
            except (_Refused, EgressError) as exc:
                collected.error(f"{where}: agent {exc}")
            except Exception as exc:  # one answer never sinks the job
                log.exception("rollout: %s: the agent's answer could not be read", where)
                collected.error(f"{where}: agent answer could not be read: {type(exc).__name__}")
            finally:
                advance(1)
            return None

        results = await asyncio.gather(*(one(g) for g in range(self.body.num_generations)))
        trajectories = [t for t in results if t is not None]
        collected.rewards += [t["reward"] for t in trajectories]
        return trajectories

    async def call(self, example: Example, generation: int) -> dict[str, Any]:
        agent = self.body.agent
        assert agent is not None
        payload = {
            "example": example.model_dump(mode="json"),
            "generation": generation,
            "model": {
                "base_url": self.inference.base_url,
                "api_key": self.api_key,
                "name": self.inference.model_name,
            },
        }
        content = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
        async with self.calls:
            reply = await self.egress.post_json(
                str(agent.url),
                content,
                headers=agent.headers,
                timeout_s=agent.timeout_s,
                max_bytes=self.max_bytes,
            )
        if len(reply.body) > THREAD_BYTES:
            return await asyncio.to_thread(
                _agent_trajectory, reply, example, generation, self.require_logprobs
            )
        return _agent_trajectory(reply, example, generation, self.require_logprobs)


def _agent_trajectory(
    reply: Reply, example: Example, generation: int, require_logprobs: bool
) -> dict[str, Any]:
    """An agent's answer `{trajectory: NAT or ART, reward?}` as one ART-style trajectory
    dict, checked as training input. Raises `_Refused` saying why not (never quoting it)."""
    if not reply.ok:
        raise _Refused(f"answered {reply.describe()}")
    try:
        answer = reply.json()
    except ValueError as exc:
        raise _Refused(f"answered HTTP {reply.status} with {exc}") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("trajectory"), dict):
        raise _Refused(
            f"answered HTTP {reply.status} without "
            '{"trajectory": {...}, "reward": number} '
            f"({len(reply.body)} bytes)"
        )
    raw = answer["trajectory"]
    reward = answer.get("reward", raw.get("reward"))
    try:
        if "episode" in raw:
            nat = NatTrajectory.model_validate({**raw, "reward": reward})
            collection = TrajectoryCollection(trajectories=[[nat]], run_id="agent")
            issues = check_collection(collection, require_logprobs=require_logprobs)
            if issues:
                raise _Refused(f"trajectory cannot be trained on: {_issue_text(issues[0], 3)}")
            (group,) = collection_to_groups(collection)
            art = ArtTrajectory.model_validate({**group["trajectories"][0], "metadata": {}})
        else:
            art = ArtTrajectory.model_validate({**raw, "reward": reward})
    except ValidationError as exc:
        raise _Refused(f"trajectory is not valid: {_validation_text(exc)}") from None
    try:
        _check(art, require_logprobs)
    except _Refused as exc:
        raise _Refused(f"trajectory {exc}") from None
    data = art.model_dump(mode="json")
    data["metadata"] = {
        **data.get("metadata", {}),
        "example_id": str(example.id),
        "generation": generation,
    }
    return data
