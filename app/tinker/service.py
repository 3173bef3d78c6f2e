"""The Tinker surface's rules: sessions, training runs, samplers, and the operations on them.

A training run (the SDK's `model_id`, `<session>:train:<seq>`) is a Trainyard model of the
cpu backend named `tinker-<session>-<seq>` (its `project` label `tinker`), over a base model
the cpu backend can load: a registered cpu model's name (its `base_model` directory) or such
a directory itself. It belongs to the project of the key that made it: a key of another
project finds no session, run, sampler, checkpoint or future of it (`visible`), and names
only its own project's models as base models. Its policy (the base model with a LoRA
adapter of the requested rank, seed and targets) lives in this process. Operations on one run
are journaled as they are accepted (`app.tinker.journal`: a restarted process makes the run
again from them) and run one at a time, in the order they arrived (an asyncio lock is
first-come first-served), in a thread, under the policy's lock.

`save_weights_for_sampler` and `save_weights` (save_state) write the adapter as the run's
next checkpoint step, so the registry lists it and the gateway serves it as `<run>@<step>`;
a sampler (`tinker://<run>/sampler_weights/<name>`) samples from a copy of the weights in
memory, or from that checkpoint (an older sampler, or one saved before a restart).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from sqlalchemy import and_, delete, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.backends.cpu import base_model_refusal
from app.checkpoints.service import delete_checkpoint as delete_registry_step
from app.checkpoints.service import set_alias
from app.db import begin_write
from app.errors import ConflictError
from app.models import (
    DEFAULT_PROJECT_ID,
    ModelAliasRow,
    ModelRow,
    TinkerSamplerRow,
    TinkerSessionRow,
)
from app.registry.demo import DEMO
from app.registry.models import create_model
from app.schemas.checkpoints import ALIAS_PATTERN, BUILTIN_ALIASES
from app.schemas.models import ModelCreate
from app.settings import Settings
from app.tenants.keys import ADMIN, Principal
from app.tinker import journal, listing, sampling, spec, wire
from app.tinker.futures import LONG_POLL_SECONDS, Futures, Result

log = logging.getLogger(__name__)

PROJECT, SCHEME = listing.PROJECT, listing.SCHEME
# Samplers that keep their weights in memory (the newest); the others read them from their
# checkpoint again when asked to sample (an RL loop makes a sampler every step).
WEIGHTS_IN_MEMORY = 8
SAMPLER = "sampler_weights"
SESSION_BYTES = 6
SESSION_PATTERN = rf"s[0-9a-f]{{{2 * SESSION_BYTES}}}"
MAX_CONTEXT = sampling.MAX_TOKENS


class TinkerError(Exception):
    """A request refused at once: `status` and a message naming the bad field."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Run:
    model_id: str  # the SDK's: `<session>:train:<seq>` (it derives it itself on load_state)
    name: str  # the registry's model, and the run in `tinker://<name>/…` paths
    base_model: str  # as the client named it
    base_dir: str
    lora: spec.Lora
    policy: Any
    vocab: int
    project_id: str  # the project of the key that made it: its registry model's
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # operations run one at a time
    accepting: asyncio.Lock = field(default_factory=asyncio.Lock)  # journaled in order
    step: int = 0  # checkpoint steps written (sampler saves)


@dataclass(frozen=True)
class _Named:
    """What the checkpoint directories need of a model."""

    name: str
    project: str


@dataclass
class Sampler:
    """What a sampling session samples from: a policy (None: the base model's, adapter off)
    with `weights` as its adapter, kept in memory for the newest samplers and read again from
    the checkpoint `directory` for the others."""

    sampler_id: str
    base_model: str
    model_path: str | None
    run: Run | None
    policy: Any | None = None
    weights: dict[str, Any] | None = None
    directory: Path | None = None
    project_id: str | None = None  # its run's, its registered base model's, or (a base
    # the operator provides: a directory, `demo`) the project of the key that made it


def operator_base(row: ModelRow) -> bool:
    """Whether `row` is a base model the operator provides, which every project's keys may
    train and sample from (a model directory under the model roots is one too): the `demo`
    model the server registers in the `default` project. Any other registered model is its
    project's alone."""
    return row.name == DEMO and row.project_id == DEFAULT_PROJECT_ID and row.backend == "cpu"


def visible(project_id: str | None, principal: Principal) -> bool:
    """Whether `principal` may reach what belongs to `project_id` (None: every project's)."""
    return project_id is None or principal.sees is None or principal.sees == project_id


class TinkerService:
    def __init__(
        self, settings: Settings, sessions: async_sessionmaker[AsyncSession], backends: Any
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.backends = backends
        self.futures = Futures()
        self.tinker_sessions: dict[str, str] = {}  # session id -> its project
        self.runs: dict[str, Run] = {}
        self.samplers: dict[str, Sampler] = {}
        self.by_path: dict[str, str] = {}  # tinker path -> sampler id
        self.saved: dict[str, tuple[str, int]] = {}  # tinker path -> (registry model, step)
        self._base_policies: dict[str, Any] = {}
        self._base_lock = asyncio.Lock()
        self._in_memory: list[Sampler] = []  # samplers holding their weights, oldest first
        self._restoring: dict[str, asyncio.Future[Run]] = {}

    async def close(self) -> None:
        await self.futures.close()

    # -- sessions and capabilities -----------------------------------------------------

    async def create_session(self, principal: Principal) -> str:
        """A new session of the key's project, recorded (`tinker_sessions`) so that it stays
        that project's after a restart."""
        session_id = f"s{secrets.token_hex(SESSION_BYTES)}"
        async with self.sessions() as session:
            session.add(TinkerSessionRow(session_id=session_id, project_id=principal.owner))
            await session.commit()
        self.tinker_sessions[session_id] = principal.owner
        return session_id

    async def heartbeat(self, session_id: str, principal: Principal) -> None:
        await self._session(session_id, principal)

    async def _session(self, session_id: Any, principal: Principal) -> str:
        """A session of this process, or one an earlier process made (its SDK goes on after
        a restart: its runs are made again from the journal), of the project recorded when
        it was made. A session is its maker's project's: another project's key is told there
        is none. An id of the sessions' form that no row records (made before they were
        recorded) becomes the first key's that uses it, and is recorded so."""
        session_id = str(session_id)
        owner = self.tinker_sessions.get(session_id)
        if owner is None and re.fullmatch(SESSION_PATTERN, session_id):
            async with self.sessions() as session:
                await begin_write(session)  # it reads, then may write
                row = await session.get(TinkerSessionRow, session_id)
                if row is None:
                    session.add(TinkerSessionRow(session_id=session_id, project_id=principal.owner))
                    try:
                        await session.commit()
                    except IntegrityError:  # another request recorded it first: its owner
                        await session.rollback()
                        row = await session.get(TinkerSessionRow, session_id)
                owner = principal.owner if row is None else row.project_id
            self.tinker_sessions[session_id] = owner
        if owner is None or not visible(owner, principal):
            raise TinkerError(404, f"session_id: no session {session_id!r}")
        return session_id

    async def capabilities(self, principal: Principal) -> list[dict[str, Any]]:
        """The cpu models the key may name as a base: its project's (every one for an admin
        key) and the operator's (`operator_base`)."""
        query = select(ModelRow).where(ModelRow.backend == "cpu")
        if principal.sees is not None:
            operators = and_(ModelRow.name == DEMO, ModelRow.project_id == DEFAULT_PROJECT_ID)
            query = query.where(or_(ModelRow.project_id == principal.sees, operators))
        async with self.sessions() as session:
            rows = (await session.scalars(query)).all()
        return [
            {
                "model_name": row.name,
                "max_context_length": MAX_CONTEXT,
                "trainable": True,
                "sampleable": True,
            }
            for row in rows
            if row.project != PROJECT
        ]

    async def resolve_base(
        self, base_model: str, principal: Principal = ADMIN
    ) -> tuple[str, str | None]:
        """The local directory of `base_model` and its project: a registered cpu model's
        name the key sees, or one the operator provides (`operator_base`), or a directory the
        cpu backend may load (no project for these two: any key may name them)."""
        async with self.sessions() as session:
            row = await session.get(ModelRow, base_model)
        if row is not None and operator_base(row):
            return row.base_model, None
        if row is not None and not visible(row.project_id, principal):
            row = None  # another project's model: as if there were none
        if row is not None:
            if row.backend != "cpu":
                raise TinkerError(
                    400,
                    f"base_model: {base_model!r} is on the {row.backend!r} backend, which does "
                    "not offer Tinker's operations (forward_backward, optim_step, sample); "
                    "use a cpu model",
                )
            return row.base_model, row.project_id
        refusal = base_model_refusal(base_model, self.settings.allowed_model_roots())
        if refusal is not None or not await asyncio.to_thread(Path(base_model).is_dir):
            raise TinkerError(
                400,
                f"base_model: {base_model!r} is neither a registered cpu model nor a model "
                "directory the cpu backend may load (see get_server_capabilities)",
            )
        return base_model, None

    # -- training runs -----------------------------------------------------------------

    async def create_model(self, body: dict[str, Any], principal: Principal) -> tuple[str, str]:
        """A new training run of the key's project: its future's request id, its model id."""
        session_id = await self._session(body.get("session_id", ""), principal)
        seq = body.get("model_seq_id")
        lora_body = body.get("lora_config") or {}
        rank = lora_body.get("rank", 32)
        if not isinstance(rank, int) or not 1 <= rank <= 256:
            raise TinkerError(400, "lora_config.rank: must be an integer from 1 to 256")
        lora = spec.Lora(
            rank=rank,
            seed=int(lora_body.get("seed") or 0),
            train_mlp=bool(lora_body.get("train_mlp", True)),
            train_attn=bool(lora_body.get("train_attn", True)),
            train_unembed=bool(lora_body.get("train_unembed", True)),
        )
        base_model = str(body.get("base_model", ""))
        base_dir, _ = await self.resolve_base(base_model, principal)
        run = await self._open_run(session_id, seq, base_model, base_dir, lora, principal.owner)
        answer = {"type": "create_model", "model_id": run.model_id}

        async def done() -> Result:
            return Result(json=answer)

        request_id = f"{run.model_id}:create"
        return self.futures.submit(request_id, done(), owner=run.project_id), run.model_id

    async def _open_run(
        self,
        session_id: str,
        seq: Any,
        base_model: str,
        base_dir: str,
        lora: spec.Lora,
        project_id: str,
    ) -> Run:
        """The run `<session>:train:<seq>` of `project_id`: its registry model and its
        policy (made once)."""
        model_id, name = f"{session_id}:train:{seq}", f"tinker-{session_id}-{seq}"
        async with self.sessions() as session:
            config = {
                "lora_rank": lora.rank,
                "lora_alpha": spec.LORA_ALPHA,
                "seed": lora.seed,
                "target_modules": lora.targets,
            }
            try:
                await create_model(
                    session,
                    body=ModelCreate(
                        name=name,
                        project=PROJECT,
                        base_model=base_dir,
                        backend="cpu",
                        config=config,
                    ),
                    model_roots=self.settings.allowed_model_roots(),
                    project_id=project_id,
                )
            except ConflictError as exc:  # the run exists, made otherwise or by another project
                # 400, not 409: the SDK sends a 409 again and again.
                raise TinkerError(400, f"model_seq_id: {exc.detail}") from exc
            await session.commit()
        if model_id not in self.runs:
            policy = await asyncio.to_thread(self._load_policy, base_dir, lora)
            self.runs[model_id] = Run(
                model_id, name, base_model, base_dir, lora, policy, vocab_size(policy), project_id
            )
        return self.runs[model_id]

    async def run(self, model_id: str, principal: Principal = ADMIN) -> Run:
        """The run `model_id`: held by this process, or made again from its registry model
        and its journal (a run of an earlier process: see `app.tinker.journal`). Another
        project's run does not exist for the key."""
        run = self.runs.get(model_id)
        if run is None:
            if principal.sees is not None:  # not made again for a key that may not see it
                await self._registry_model(model_id, "model_id", principal)
            task = self._restoring.get(model_id)
            if task is None:
                task = asyncio.ensure_future(self._restore(model_id))
                self._restoring[model_id] = task
                task.add_done_callback(lambda _: self._restoring.pop(model_id, None))
            run = await asyncio.shield(task)
        if not visible(run.project_id, principal):
            raise TinkerError(404, f"model_id: no training run {model_id!r}")
        return run

    async def _registry_model(self, run_id: str, field: str, principal: Principal) -> ModelRow:
        """The registry model of a run (named either way), if the key may see it."""
        async with self.sessions() as session:
            row = await session.get(ModelRow, listing.run_name(run_id))
        if row is None or row.project != PROJECT or not visible(row.project_id, principal):
            raise TinkerError(404, f"{field}: no training run {run_id!r}")
        return row

    async def _restore(self, model_id: str) -> Run:
        name = listing.run_name(model_id)
        async with self.sessions() as session:
            row = await session.get(ModelRow, name)
        if row is None or row.project != PROJECT or ":train:" not in model_id:
            raise TinkerError(404, f"model_id: no training run {model_id!r}")
        lora = lora_of(row)
        policy = await asyncio.to_thread(self._load_policy, row.base_model, lora)
        run = Run(
            model_id,
            name,
            row.base_model,
            row.base_model,
            lora,
            policy,
            vocab_size(policy),
            row.project_id,
        )
        async with run.lock:  # operations accepted meanwhile wait for the replay
            self.runs[model_id] = run
            ops = await journal.operations(self.sessions, name)
            pending: dict[str, asyncio.Future[Result]] = {}
            for op in ops:
                if not op.done:  # a retrieve of it waits for the replay to do it
                    pending[op.request_id] = asyncio.get_running_loop().create_future()
                    self.futures.submit(op.request_id, pending[op.request_id], owner=run.project_id)
            await self._replay(run, ops, pending)
        return run

    async def _replay(
        self, run: Run, ops: list[journal.Operation], pending: dict[str, asyncio.Future[Result]]
    ) -> None:
        """Do the run's journaled operations over, in order: what was done before only for
        its effect on the policy (its answer stands), what was not done for good."""
        index = 0
        async for body in journal.bodies(self.sessions, ops):
            op = ops[index]
            index += 1
            if op.done and op.kind in ("save_weights", "save_weights_for_sampler"):
                if op.step is not None and op.path is not None:
                    run.step = max(run.step, op.step)
                    self.saved[op.path] = (run.name, op.step)
                continue  # written when it was done
            if op.done and op.kind == "forward":
                continue  # changed nothing
            try:
                result, step, path = await self._execute(run, op.kind, body)
            except Exception as exc:
                log.exception("tinker run %s: replaying %s failed", run.name, op.request_id)
                error = f"{type(exc).__name__}: {exc}"
                result, step, path = Result(error=error, category="server"), None, None
            if not op.done:
                await journal.finish(self.sessions, op.request_id, result, step=step, path=path)
                pending[op.request_id].set_result(result)

    async def info(self, model_id: str, principal: Principal) -> dict[str, Any]:
        run = await self.run(model_id, principal)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": "lora",
                "model_name": run.base_model,
                "tokenizer_id": run.base_dir,
            },
            "is_lora": True,
            "lora_rank": run.lora.rank,
            "model_name": run.base_model,
        }

    async def submit(self, run: Run, seq_id: Any, kind: str, body: bytes) -> str:
        """Accept an operation: journal it, then do it after the run's earlier ones (the
        run's lock is first-come first-served). The same `seq_id` again is the same
        operation, done once."""
        request_id = f"{run.model_id}:{kind}:{seq_id}"
        async with run.accepting:
            if self.futures.known(request_id):
                return request_id
            accepted = await journal.accept(
                self.sessions,
                request_id=request_id,
                model_name=run.name,
                model_id=run.model_id,
                kind=kind,
                body=body,
            )
            work = self._do(run, request_id, kind, body) if accepted else self._stored(request_id)
            self.futures.submit(request_id, work, owner=run.project_id)
        return request_id

    async def _do(self, run: Run, request_id: str, kind: str, body: bytes) -> Result:
        async with run.lock:
            result, step, path = await self._execute(run, kind, body)
        # Written after the lock: the run's next operation runs meanwhile. The answer is
        # given once it is written; the order answers are written in does not matter (a
        # replay does every operation over in the order it was accepted, done or not).
        await journal.finish(self.sessions, request_id, result, step=step, path=path)
        return result

    async def _stored(self, request_id: str) -> Result:
        """An operation accepted before whose future this process no longer holds: its
        answer. (One not done yet has a future here: the replay that does it made one.)"""
        result = await journal.result(self.sessions, request_id)
        if result is None:
            return Result(error=f"{request_id}: accepted, not done yet", category="server")
        return result

    async def _execute(
        self, run: Run, kind: str, body: bytes
    ) -> tuple[Result, int | None, str | None]:
        """Do one operation on the run (its lock held): the answer, and a save's step and
        path."""
        try:
            if kind in ("forward", "forward_backward"):
                request = wire.read_forward_backward(body)

                def step_of(policy: Any) -> Result:
                    outputs, metrics = _trainer().forward_backward(
                        policy,
                        request.data,
                        request.loss_fn,
                        request.loss_fn_config,
                        backward=kind == "forward_backward",
                    )
                    return Result(proto=wire.write_forward_backward_output(outputs, metrics))

                return await asyncio.to_thread(self._locked, run, step_of), None, None
            fields = json.loads(body)
            if kind == "optim_step":
                params = spec.check_adam(fields.get("adam_params"))

                def optim(policy: Any) -> Result:
                    return Result(json={"metrics": _trainer().optim_step(policy, params)})

                return await asyncio.to_thread(self._locked, run, optim), None, None
            if kind == "load_weights":
                path = fields.get("path")
                _, directory = await self._checkpoint(path)
                with_optimizer = bool(fields.get("optimizer"))

                def load(policy: Any) -> Result:
                    _trainer().load_state(policy, directory, with_optimizer=with_optimizer)
                    return Result(
                        json={"type": "load_weights", "path": path, "model_id": run.model_id}
                    )

                return await asyncio.to_thread(self._locked, run, load), None, None
            return await self._save_now(run, kind, fields.get("path"))
        except spec.UserError as exc:
            return Result(error=str(exc), category="user"), None, None
        except TinkerError as exc:
            return Result(error=str(exc), category="user"), None, None

    @staticmethod
    def _locked(run: Run, work: Any) -> Result:
        with run.policy.lock:
            result: Result = work(run.policy)
            return result

    async def forward_backward(
        self, request: wire.ForwardBackwardRequest, raw: bytes, principal: Principal
    ) -> str:
        run = await self.run(request.model_id, principal)
        try:  # before it is queued: the SDK raises a 400 as BadRequestError
            spec.check_data(run.vocab, request.loss_fn, request.data)
            spec.check_config(request.loss_fn_config)
        except spec.UserError as exc:
            raise TinkerError(400, str(exc)) from exc
        kind = "forward" if request.forward_only else "forward_backward"
        return await self.submit(run, request.seq_id, kind, raw)

    async def optim_step(self, body: dict[str, Any], principal: Principal) -> str:
        run = await self.run(str(body.get("model_id", "")), principal)
        try:  # before it is queued, as a forward_backward's data
            spec.check_adam(body.get("adam_params"))
        except spec.UserError as exc:
            raise TinkerError(400, str(exc)) from exc
        return await self.submit(run, body.get("seq_id"), "optim_step", _json(body))

    async def save(self, body: dict[str, Any], kind: str, principal: Principal) -> str:
        """`save_weights_for_sampler` (kind `sampler_weights`) or `save_weights` (`weights`,
        the SDK's save_state): the adapter (and the optimizer's state) as the run's next
        checkpoint step. A name that can be an alias becomes one: as itself for a sampler's
        weights (the gateway serves `<run>@<name>`), as `state-<name>` for a state (so a
        `tinker://` path of it resolves after a restart)."""
        run = await self.run(str(body.get("model_id", "")), principal)
        name = body.get("path")
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise TinkerError(400, "path: a name without `/`")
        operation = "save_weights_for_sampler" if kind == SAMPLER else "save_weights"
        return await self.submit(run, body.get("seq_id"), operation, _json(body))

    async def _save_now(
        self, run: Run, operation: str, name: str | None
    ) -> tuple[Result, int | None, str | None]:
        kind = SAMPLER if operation == "save_weights_for_sampler" else "weights"
        alias = None if name is None else name if kind == SAMPLER else f"state-{name}"
        weights, step = await asyncio.to_thread(self._save, run)
        async with self.sessions() as session:
            await begin_write(session)
            if alias and re.fullmatch(ALIAS_PATTERN, alias) and alias not in BUILTIN_ALIASES:
                await set_alias(session, self.backends, name=run.name, alias=alias, step=step)
            # The model's current step is the newest save: `<run>`, `<run>@latest` and
            # `<run>@<step>` name it at the gateway.
            await session.execute(
                update(ModelRow)
                .where(ModelRow.name == run.name, ModelRow.current_step < step)
                .values(current_step=step, step_known=True)
            )
            await session.commit()
        path = f"{SCHEME}{run.name}/{kind}/{name or f'{step:06d}'}"
        self.saved[path] = (run.name, step)
        if kind != SAMPLER:
            return Result(json={"type": "save_weights", "path": path}), step, path
        sampler = await self._new_sampler(
            run.base_model,
            path,
            run=run,
            policy=run.policy,
            weights=weights,
            directory=self._directory(run, step),
            project_id=run.project_id,
        )
        answer = {
            "type": "save_weights_for_sampler",
            "path": path if name else None,
            "sampling_session_id": None if name else sampler.sampler_id,
        }
        return Result(json=answer), step, path

    def _directory(self, run: Run, step: int) -> Path:
        return Path(self.backends.get("cpu").backend.location(_Named(run.name, PROJECT), step))

    def _save(self, run: Run) -> tuple[dict[str, Any], int]:
        """The adapter's weights now, also written as the run's next checkpoint step (a row of
        the registry: listed, exported, served by the gateway as `<run>@<step>`)."""
        dirs = self.backends.get("cpu").backend
        model = _Named(run.name, PROJECT)
        with run.policy.lock:
            weights = _trainer().adapter_state(run.policy)
            step = dirs.step_on_disk(model) + 1
            with dirs.writing(model, step) as partial:
                run.policy.save(partial, step)
        run.step = step
        return weights, step

    async def _checkpoint(
        self, path: Any, field: str = "path", principal: Principal = ADMIN
    ) -> tuple[ModelRow, Path]:
        """The registry model and the checkpoint directory a `tinker://` path names: a save
        of this process or of the journal, or one whose name is an alias (see `save`). A
        run of a project the key does not see has none."""
        row, _, directory = await self._checkpoint_step(path, field, principal)
        return row, directory

    async def _checkpoint_step(
        self, path: Any, field: str, principal: Principal
    ) -> tuple[ModelRow, int, Path]:
        """`_checkpoint`, with the step the path names."""
        if not isinstance(path, str) or not path.startswith(SCHEME):
            raise TinkerError(400, f"{field}: a tinker:// path")
        parts = path.removeprefix(SCHEME).split("/")
        if len(parts) != 3 or parts[1] not in (SAMPLER, "weights"):
            raise TinkerError(
                400, f"{field}: {path!r} is not tinker://<run>/<weights|sampler_weights>/<name>"
            )
        found = self.saved.get(path) or await journal.saved(self.sessions, path)
        async with self.sessions() as session:
            row = await session.get(ModelRow, parts[0])
            if found is None and row is not None:
                alias = parts[2] if parts[1] == SAMPLER else f"state-{parts[2]}"
                aliased = await session.get(ModelAliasRow, (row.name, alias))
                found = None if aliased is None else (row.name, aliased.step)
        dirs = self.backends.get("cpu").backend
        directory = None
        if row is not None and not visible(row.project_id, principal):
            row = None
        if row is not None and row.project == PROJECT and found is not None:
            directory = await asyncio.to_thread(
                dirs.checkpoint, _Named(row.name, PROJECT), found[1]
            )
        if row is None or found is None or directory is None:
            raise TinkerError(404, f"{field}: no checkpoint at {path!r}")
        return row, found[1], directory

    async def weights_info(self, body: dict[str, Any], principal: Principal) -> dict[str, Any]:
        """What loading a checkpoint needs (the SDK's `WeightsInfoResponse`)."""
        row, _, _ = await self._checkpoint_step(body.get("tinker_path"), "tinker_path", principal)
        lora = lora_of(row)
        return {
            "base_model": row.base_model,
            "is_lora": True,
            "lora_rank": lora.rank,
            "train_unembed": lora.train_unembed,
            "train_mlp": lora.train_mlp,
            "train_attn": lora.train_attn,
        }

    async def delete_checkpoint(
        self, training_run_id: str, checkpoint_id: str, principal: Principal
    ) -> None:
        """The registry's step the checkpoint is, deleted with the alias its name made: a
        step the registry protects (the run's latest; another alias points at it) is a 400
        that says why (the SDK retries a 409 for minutes), and nothing is deleted."""
        name = listing.run_name(training_run_id)
        path = f"{SCHEME}{name}/{checkpoint_id}"
        row, step, _ = await self._checkpoint_step(path, "checkpoint_id", principal)
        kind, _, label = checkpoint_id.partition("/")
        alias = label if kind == SAMPLER else f"state-{label}"
        async with self.sessions() as session:
            await session.execute(
                delete(ModelAliasRow).where(
                    ModelAliasRow.model_name == row.name,
                    ModelAliasRow.alias == alias,
                    ModelAliasRow.step == step,
                )
            )
            try:
                await delete_registry_step(session, self.backends, name=row.name, step=step)
            except ConflictError as exc:  # protected: the SDK would retry a 409 for minutes
                raise TinkerError(400, f"checkpoint_id: {exc.detail}") from exc
            await session.commit()
        for saved in [p for p, where in self.saved.items() if where == (row.name, step)]:
            del self.saved[saved]

    async def load(self, body: dict[str, Any], principal: Principal) -> tuple[str, str]:
        """`load_weights`: into a run (`model_id`: load_state), or into a new run of the
        session (`session_id`, `model_seq_id`: create_training_client_from_state) with the
        checkpoint's LoRA config. With `optimizer`, the optimizer's state too."""
        path = body.get("path")
        row, _ = await self._checkpoint(path, principal=principal)
        if body.get("session_id") is not None:
            session_id = await self._session(body["session_id"], principal)
            lora = lora_of(row)
            base = str(body.get("base_model") or row.base_model)
            base_dir, _ = await self.resolve_base(base, principal)
            seq = body.get("model_seq_id")
            run = await self._open_run(session_id, seq, base, base_dir, lora, principal.owner)
            seq_id: Any = 0
        else:
            run = await self.run(str(body.get("model_id", "")), principal)
            seq_id = body.get("seq_id")
        fields = {"path": path, "optimizer": bool(body.get("optimizer"))}
        return await self.submit(run, seq_id, "load_weights", _json(fields)), run.model_id

    # -- the RestClient's views ----------------------------------------------------------

    async def user_checkpoints(
        self, limit: int, offset: int, principal: Principal
    ) -> dict[str, Any]:
        """Every checkpoint of the runs the key sees, newest first (`list_user_checkpoints`)."""
        if not 1 <= limit <= 1000 or offset < 0:
            raise TinkerError(400, "limit: from 1 to 1000, and offset: 0 or more")
        async with self.sessions() as session:
            page = (limit, offset)
            return await listing.user_checkpoints(
                session, self._dirs(), self.saved, page, principal.sees
            )

    async def training_runs(self, limit: int, offset: int, principal: Principal) -> dict[str, Any]:
        if not 1 <= limit <= 1000 or offset < 0:
            raise TinkerError(400, "limit: from 1 to 1000, and offset: 0 or more")
        async with self.sessions() as session:
            return await listing.training_runs(
                session, self._dirs(), self.saved, limit, offset, sees=principal.sees
            )

    async def training_run(
        self, training_run_id: str, principal: Principal, *, checkpoints: bool = False
    ) -> Any:
        row = await self._registry_model(training_run_id, "training_run_id", principal)
        async with self.sessions() as session:
            if checkpoints:
                found = await listing.checkpoints(session, self._dirs(), self.saved, row.name)
                return {"checkpoints": found}
            return await listing.training_run(session, self._dirs(), self.saved, row)

    def _dirs(self) -> Any:
        return self.backends.get("cpu").backend

    # -- sampling ----------------------------------------------------------------------

    def _add_sampler(self, sampler: Sampler) -> Sampler:
        self.samplers[sampler.sampler_id] = sampler
        if sampler.model_path is not None:
            self.by_path[sampler.model_path] = sampler.sampler_id
        if sampler.weights is not None:  # the newest keep their weights in memory
            self._in_memory.append(sampler)
            while len(self._in_memory) > WEIGHTS_IN_MEMORY:
                self._in_memory.pop(0).weights = None
        return sampler

    async def _new_sampler(self, base_model: str, path: str | None, **source: Any) -> Sampler:
        """A sampling session, recorded so that a restarted process samples from it again."""
        sampler_id = f"sampler-{secrets.token_hex(6)}"
        async with self.sessions() as session:
            session.add(
                TinkerSamplerRow(
                    sampler_id=sampler_id,
                    base_model=base_model,
                    model_path=path,
                    project_id=source.get("project_id"),
                )
            )
            await session.commit()
        return self._add_sampler(Sampler(sampler_id, base_model, path, **source))

    async def create_sampling_session(self, body: dict[str, Any], principal: Principal) -> str:
        path, base = body.get("model_path"), body.get("base_model")
        if path:
            found = self.by_path.get(str(path))
            if found is not None and visible(self.samplers[found].project_id, principal):
                # Still in the registry (a checkpoint deleted since is not sampled again),
                # and its weights are the ones this process already holds.
                await self._checkpoint(path, "model_path", principal)
                old = self.samplers[found]
                source = {
                    "policy": old.policy,
                    "weights": old.weights,
                    "directory": old.directory,
                    "project_id": old.project_id,
                }
                made = await self._new_sampler(
                    old.base_model, old.model_path, run=old.run, **source
                )
                return made.sampler_id
            # Saved by an earlier process: the journal, or an alias, knows its step.
            base_model, source = await self._from_path(path, "model_path", principal)
            return (await self._new_sampler(base_model, str(path), **source)).sampler_id
        if not base:
            raise TinkerError(400, "base_model: required when model_path is not given")
        _, project_id = await self.resolve_base(str(base), principal)
        # A registered base model's project, else (the operator's: a directory, `demo`) the
        # key's: a sampler is always some project's.
        owner = project_id or principal.owner
        made = await self._new_sampler(str(base), None, run=None, project_id=owner)
        return made.sampler_id

    async def _from_path(
        self, path: Any, field: str, principal: Principal = ADMIN
    ) -> tuple[str, dict[str, Any]]:
        """What a sampler of a saved `tinker://` path samples with: the run's base model, a
        policy of its LoRA config, the checkpoint directory its weights are read from, and
        the run's project."""
        row, directory = await self._checkpoint(path, field, principal)
        policy = await self._restored_policy(row)
        source = {"run": None, "policy": policy, "directory": directory}
        return row.base_model, {**source, "project_id": row.project_id}

    async def _restored_policy(self, row: ModelRow) -> Any:
        """A policy for a run of an earlier process: its base model and LoRA config."""
        live = next((run for run in self.runs.values() if run.name == row.name), None)
        if live is not None:
            return live.policy
        async with self._base_lock:
            if row.name not in self._base_policies:
                self._base_policies[row.name] = await asyncio.to_thread(
                    self._load_policy, row.base_model, lora_of(row)
                )
            return self._base_policies[row.name]

    async def retrieve(self, request_id: str, principal: Principal) -> Result | None:
        """A future's result; None when it is not ready within the long poll. One this
        process never held is answered from the journal (done), or once its run has been
        made again and the replay has done it. KeyError: no such request (or another
        project's, which the key may not know of)."""
        if self.futures.known(request_id):
            if not visible(self.futures.owner(request_id), principal):
                raise KeyError(request_id)
        else:
            found = await journal.find(self.sessions, request_id)
            if found is None:
                raise KeyError(request_id)
            try:
                await self._registry_model(found.model_id, "request_id", principal)
            except TinkerError:
                raise KeyError(request_id) from None
            if found.done:
                return await journal.result(self.sessions, request_id)
            restoring = asyncio.ensure_future(self.run(found.model_id))
            done, _ = await asyncio.wait({restoring}, timeout=LONG_POLL_SECONDS)
            if not done:
                return None  # the SDK asks again; the replay goes on
            restoring.result()
            if not self.futures.known(request_id):
                return await journal.result(self.sessions, request_id)
        return await self.futures.wait(request_id)

    async def sampler(self, sampler_id: str, principal: Principal) -> Sampler:
        """A sampling session of this process, or one an earlier process recorded (made
        again from its path or base model); another project's is none."""
        sampler = self.samplers.get(sampler_id) or await self._recorded_sampler(sampler_id)
        if sampler is None or not visible(sampler.project_id, principal):
            raise TinkerError(404, f"sampling_session_id: no sampler {sampler_id!r}")
        return sampler

    async def _recorded_sampler(self, sampler_id: str) -> Sampler | None:
        async with self.sessions() as session:
            row = await session.get(TinkerSamplerRow, sampler_id)
            base = None if row is None else await session.get(ModelRow, row.base_model)
        if row is None:
            return None
        if row.model_path is None:
            project_id = row.project_id or (None if base is None else base.project_id)
            sampler = Sampler(sampler_id, row.base_model, None, run=None, project_id=project_id)
            return self._add_sampler(sampler)
        base_model, source = await self._from_path(row.model_path, "sampling_session_id")
        return self._add_sampler(Sampler(sampler_id, base_model, row.model_path, **source))

    def _load_policy(self, base_dir: str, lora: spec.Lora) -> Any:
        """A policy of `base_dir` with a fresh adapter, where and as the settings say (in a
        thread: it reads the model's files)."""
        settings = self.settings
        return _trainer().load_policy(base_dir, lora, settings.cpu_device, settings.cpu_threads)

    async def _base_policy(self, base_model: str) -> Any:
        async with self._base_lock:
            if base_model not in self._base_policies:
                base_dir, _ = await self.resolve_base(base_model)
                lora = spec.Lora(rank=1, seed=0)
                self._base_policies[base_model] = await asyncio.to_thread(
                    self._load_policy, base_dir, lora
                )
            return self._base_policies[base_model]

    async def asample(self, body: dict[str, Any], principal: Principal) -> dict[str, Any]:
        sampler = await self.sampler(str(body.get("sampling_session_id", "")), principal)
        try:  # before it is queued: the SDK raises a 400 as BadRequestError
            asked = sampling.read(body)
            policy = sampler.policy or await self._base_policy(sampler.base_model)
            stop_ids = self._stop_ids(policy, asked.stop)
            sampling.check_vocabulary(asked, vocab_size(policy))
        except spec.UserError as exc:
            raise TinkerError(400, str(exc)) from exc
        request_id = f"{sampler.sampler_id}:sample:{body.get('seq_id')}"
        lock = sampler.run.lock if sampler.run else asyncio.Lock()

        def work() -> Result:
            weights = sampler.weights
            if weights is None and sampler.directory is not None:
                weights = _trainer().read_adapter(sampler.directory, policy.device)
            with policy.lock:
                answer = wire.SampleAnswer([])
                if asked.scores_prompt:
                    answer = _trainer().score_prompt(policy, weights, asked)
                answer.sequences = _trainer().sample(policy, weights, asked, stop_ids)
            return Result(proto=wire.write_sample_response(answer))

        async def go() -> Result:
            async with lock:
                return await asyncio.to_thread(work)

        self.futures.submit(request_id, go(), owner=sampler.project_id)
        return {
            "request_id": request_id,
            "sample_sequence_ids": [f"{request_id}:{i}" for i in range(asked.num_samples)],
        }

    @staticmethod
    def _stop_ids(policy: Any, stop: list[Any]) -> set[int]:
        ids: set[int] = set()
        for item in stop:
            if isinstance(item, int):
                ids.add(item)
                continue
            if not isinstance(item, str):
                raise spec.UserError(f"sampling_params.stop: {item!r} is no string or token id")
            encoded = policy.tokenizer(item, add_special_tokens=False)["input_ids"]
            if len(encoded) != 1:
                raise spec.UserError(
                    f"sampling_params.stop: {item!r} is not one token here; give token ids"
                )
            ids.add(encoded[0])
        return ids


def _trainer() -> ModuleType:
    """The torch side, imported where a run is made or used: an API process that never
    sees a Tinker request never imports torch."""
    from app.tinker import trainer

    return trainer


def lora_of(row: ModelRow) -> spec.Lora:
    """The LoRA config a run's registry model was made with."""
    config = row.config or {}
    targets = config.get("target_modules") or []
    return spec.Lora(
        rank=int(config.get("lora_rank", 8)),
        seed=int(config.get("seed", 0)),
        train_mlp="up_proj" in targets,
        train_attn="q_proj" in targets,
        train_unembed="lm_head" in targets,
    )


def vocab_size(policy: Any) -> int:
    return int(policy.model.get_input_embeddings().weight.shape[0])


def _json(body: dict[str, Any]) -> bytes:
    """An operation's body as the journal keeps it."""
    return json.dumps(body, separators=(",", ":")).encode()
