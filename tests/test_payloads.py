"""Stored specs: what a queued job holds, and jobs queued by earlier versions."""

from __future__ import annotations

import shutil
import tracemalloc
from pathlib import Path

import pytest
from sqlalchemy import select

from app.backends import Backends
from app.db import create_engine
from app.ingest import jsontext
from app.jobs import payloads
from app.jobs.lifecycle import JobStatus, Released
from app.jobs.payloads import Payload, UnknownPayloadFormat
from app.jobs.store import store_for
from app.migrate import current_revision, head_revision, migrate
from app.models import JobEventRow, JobRow
from app.notify import Notifier
from app.rollouts import spec as rollout_spec
from app.settings import Settings
from app.training import spec as training_spec
from app.worker import Worker
from tests import factories as f
from tests.backends import RecordingBackend

LEGACY = Path(__file__).parent / "data" / "queued-at-0003.sqlite"


async def test_jobs_queued_before_versioned_specs_still_run(tmp_path: Path) -> None:
    path = tmp_path / "trainyard.db"
    shutil.copy(LEGACY, path)
    settings = Settings(database_url=f"sqlite+aiosqlite:///{path}", data_dir=tmp_path / "data")
    engine = create_engine(settings.database_url)
    try:
        await migrate(engine)  # the upgrade
        async with engine.connect() as conn:
            assert await current_revision(conn) == head_revision()
        store = store_for(engine)
        backend = RecordingBackend(tmp_path / "backend")
        worker = Worker(
            settings=settings,
            store=store,
            backends=Backends(settings, {"dry-run": backend}),
            notifier=Notifier(),
        )
        claims = await store.claim(owner="test", lease_seconds=30, limit=3)
        by_kind = {c.lease.kind.value: c for c in claims}
        assert {c.payload.format for c in claims} == {
            training_spec.REQUEST_V0,
            rollout_spec.REQUEST_V0,
        }
        recipe = rollout_spec.decode(by_kind["rollout"].payload)
        assert [e.id for e in recipe.examples] == ["q1"] and recipe.num_generations == 2
        assert recipe.grader is not None and recipe.grader.type == "exact_match"
        assert recipe.train is not None and recipe.train.hyperparameters == {"learning_rate": 0.02}
        assert await store.apply(by_kind["rollout"].lease, Released("test")) is JobStatus.queued
        # The two training jobs, one after the other (one running job per model).
        await worker.process(by_kind["training"])
        [second] = await store.claim(owner="test", lease_seconds=30)
        await worker.process(second)
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(JobRow.status, JobRow.final_step, JobRow.meta.label("meta"))
                    .where(JobRow.kind == "training")
                    .order_by(JobRow.id)
                )
            ).all()
            ends = await conn.scalar(
                select(JobEventRow.data).where(
                    JobEventRow.job_id == second.lease.job_id,
                    JobEventRow.type == "training_ended",
                )
            )
        assert [(r.status, r.final_step, r.meta) for r in rows] == [
            ("succeeded", 1, {"source": "nat"}),
            ("succeeded", 2, {"source": "art"}),
        ]
        assert ends["final_step"] == 2
        nat_groups, art_groups = backend.calls[0][1], backend.calls[1][1]
        assert [len(g.trajectories) for g in nat_groups] == [2, 2]
        assert [[t.reward for t in g.trajectories] for g in art_groups] == [[1.0, 0.0], [0.5, 0.25]]
        assert backend.calls[0][2] == {"learning_rate": 1e-5}
    finally:
        await engine.dispose()


def test_new_jobs_store_the_current_spec_and_an_unknown_format_is_refused() -> None:
    groups = f.art_groups([[1.0, 0.0]])
    payload = training_spec.encode(groups)
    assert payload.format == training_spec.V1
    [group] = training_spec.decode(payload)
    assert [t.reward for t in group.trajectories] == [1.0, 0.0]
    with pytest.raises(UnknownPayloadFormat, match=r"trainyard\.training\.v9"):
        training_spec.decode(Payload("trainyard.training.v9+json;zstd", payload.data, 1))


def _large_groups() -> list[dict[str, object]]:
    """ART-style groups whose JSON is about 6 MB and compresses well, as specs do."""
    groups = f.art_groups([[1.0, 0.0]] * 40)
    text = "a step of reasoning " * 20
    for group in groups:
        for trajectory in group["trajectories"]:
            trajectory["messages_and_choices"] = [
                {"role": "user", "content": f"{text} {n}"} for n in range(180)
            ]
    return groups


def test_a_spec_is_compressed_a_piece_at_a_time_into_a_frame_of_its_own_size() -> None:
    """The whole text is never held (the compressor is fed a MiB at a time), and what is
    stored keeps only the frame's bytes allocated: zstd's one-shot `compress` returns an
    object that keeps its worst-case buffer (about the text's size) for as long as it lives."""
    groups = _large_groups()
    text = jsontext.dumps_bytes({"groups": groups})
    assert len(text) > 5 * 2**20
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        payload = training_spec.encode(groups)
        held, peak = tracemalloc.get_traced_memory()
        one_shot = payloads.compress(text)
        held_by_compress, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert payload.size == len(text)
    assert payloads.decompress(payload.data, payload.size) == text
    assert len(payload.data) < len(text) / 5
    assert held - before < 2 * len(payload.data) + 2**20, (held - before, len(payload.data))
    assert peak - before < 3 * payloads.FEED, (peak - before, len(text))
    assert payloads.decompress(one_shot, len(text)) == text
    assert held_by_compress - held < 2 * len(one_shot) + 2**20
    assert training_spec.stored_groups(payload) == groups
