"""A Tinker run's journal: operations accepted and not yet done when their process died are
done by the next process, in order, with the answers and weights of a run that never
stopped; a retrieve is answered from the journal; a request sent again is not done twice.

Processes are `TinkerService` objects over one database and data directory: the first is
dropped with its operations queued behind the run's lock (its tasks cancelled, as a killed
process's are), the next knows the run only from the registry and the journal. The bodies
of `forward_backward` are the SDK's own protobuf (its encoder, in `.venv-tinker`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from app.models import TinkerOperationRow
from app.tenants.keys import ADMIN
from app.tinker import journal, wire
from app.tinker.futures import Result
from app.tinker.service import TinkerService
from tests.conftest import LiveServer
from tests.test_tinker_wire import sdk

pytestmark = [pytest.mark.torch]

ENCODE = """
import sys, numpy as np
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

tokens = list(range(3, 15))
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])),
        "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32)),
    })
request = types.ForwardBackwardRequest(
    forward_backward_input=types.ForwardBackwardInput(data=[datum, datum], loss_fn="cross_entropy"),
    model_id=sys.argv[1], seq_id=int(sys.argv[2]))
sys.stdout.buffer.write(forward_backward_request_to_proto(request).SerializeToString())
"""
ADAM = {"learning_rate": 0.02}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from app.backends.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("journal-models") / "tiny")


@pytest.fixture
async def live(serve: Callable[..., LiveServer], tiny_model: Path) -> Any:
    async with serve(model_roots=[tiny_model.parent]) as server:
        yield server


async def start_run(service: TinkerService, base: Path) -> str:
    session = await service.create_session(ADMIN)
    lora = {"rank": 4, "seed": 5}
    body = {"session_id": session, "model_seq_id": 0, "base_model": str(base), "lora_config": lora}
    _, model_id = await service.create_model(body, ADMIN)
    return model_id


async def accept_step(service: TinkerService, model_id: str) -> tuple[str, str]:
    """`forward_backward` then `optim_step`, accepted: their request ids."""
    raw = sdk(ENCODE, model_id, "1")
    backward = await service.forward_backward(wire.read_forward_backward(raw), raw, ADMIN)
    step = await service.optim_step({"model_id": model_id, "seq_id": 2, "adam_params": ADAM}, ADMIN)
    return backward, step


async def answer(service: TinkerService, request_id: str) -> Result:
    result = await service.retrieve(request_id, ADMIN)
    assert result is not None and result.error is None, result
    return result


def adapter(service: TinkerService, model_id: str) -> dict[str, Any]:
    from app.tinker import trainer

    return trainer.adapter_state(service.runs[model_id].policy)


async def test_operations_accepted_before_a_crash_are_done_after_it(
    live: LiveServer, tiny_model: Path
) -> None:
    state = live.app.state

    def process() -> TinkerService:
        return TinkerService(state.settings, state.sessions, state.backends)

    first = process()
    model_id = await start_run(first, tiny_model)
    run = await first.run(model_id)
    async with run.lock:  # busy: both wait in line, journaled, when the process dies
        backward, step = await accept_step(first, model_id)
        await first.futures.close()
    del first

    after = process()  # knows the run only from the registry and the journal
    stepped = await answer(after, step)  # the run is made again, its operations done
    summed = await answer(after, backward)

    same = process()  # the same operations on a run that never stopped
    other = await start_run(same, tiny_model)
    other_backward, other_step = await accept_step(same, other)
    assert summed.proto == (await answer(same, other_backward)).proto
    assert stepped.json == (await answer(same, other_step)).json
    theirs = adapter(same, other)
    for name, tensor in adapter(after, model_id).items():
        assert tensor.equal(theirs[name]), name
    # The step moved the weights: they are not those a new run of the same seed starts from.
    start = adapter(same, await start_run(same, tiny_model))
    assert any(not t.equal(start[n]) for n, t in theirs.items())

    # Asked again by a third process: the journal's answer, with nothing done again.
    again = process()
    assert (await answer(again, step)).json == stepped.json
    assert (await answer(again, backward)).proto == summed.proto
    assert model_id not in again.runs

    # The SDK sends a request again (a reply it lost): the same id, done once.
    assert await after.optim_step({"model_id": model_id, "seq_id": 2}, ADMIN) == step
    async with state.sessions() as session:
        rows = await session.scalar(
            select(func.count()).where(TinkerOperationRow.model_id == model_id)
        )
    assert rows == 2


async def test_a_retrieve_of_an_unknown_request_is_a_key_error(live: LiveServer) -> None:
    state = live.app.state
    service = TinkerService(state.settings, state.sessions, state.backends)
    with pytest.raises(KeyError):
        await service.retrieve("s000000000000:train:0:optim_step:9", ADMIN)


async def test_the_runs_steps_are_paged_from_its_journal_with_their_losses(
    live: LiveServer, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`GET /v1/models/{run}/tinker-metrics`: each done `optim_step` a step, with the summed
    `loss:sum` of the `forward_backward` calls done since the step before; a call not yet
    stepped is no point; over HTTP, on each database."""
    state = live.app.state
    service = TinkerService(state.settings, state.sessions, state.backends)
    model_id = await start_run(service, tiny_model)
    run = (await service.run(model_id)).name
    losses: list[float] = []
    seq = 0

    async def backward() -> float:
        nonlocal seq
        seq += 1
        raw = sdk(ENCODE, model_id, str(seq))
        request_id = await service.forward_backward(wire.read_forward_backward(raw), raw, ADMIN)
        proto = (await answer(service, request_id)).proto
        assert proto is not None
        return wire.read_output_metrics(proto)["loss:sum"]

    async def step(rate: float) -> None:
        nonlocal seq
        seq += 1
        body = {"model_id": model_id, "seq_id": seq, "adam_params": {"learning_rate": rate}}
        await answer(service, await service.optim_step(body, ADMIN))

    for calls, rate in ((1, 0.02), (2, 0.01), (1, 0.005)):
        losses.append(sum([await backward() for _ in range(calls)]))
        await step(rate)
    await backward()  # not stepped yet

    path = f"/v1/models/{run}/tinker-metrics"
    first = (await live.client.get(path, params={"limit": 2})).json()
    assert first["has_more"] and first["next_cursor"] == "2"
    rest = (await live.client.get(path, params={"after": 2})).json()
    assert not rest["has_more"]
    steps = first["data"] + rest["data"]
    assert [(s["step"], s["forward_backward"]) for s in steps] == [(1, 1), (2, 2), (3, 1)]
    assert [s["loss"] for s in steps] == losses
    assert [s["learning_rate"] for s in steps] == [0.02, 0.01, 0.005]
    assert losses[0] > losses[-1]  # the steps trained
    # A page is read a slice of steps at a time: the same rows, whatever the slice.
    monkeypatch.setattr(journal, "STEPS_READ", 2)
    whole = (await live.client.get(path)).json()
    assert whole["data"] == steps and not whole["has_more"]
    for after in (3, 99):  # the last step; past the run
        empty = await live.client.get(path, params={"after": after})
        assert empty.json() == {"data": [], "has_more": False, "next_cursor": None}
    middle = (await live.client.get(path, params={"after": 1, "limit": 1})).json()
    assert middle["data"] == [steps[1]] and middle["next_cursor"] == "2"
    # A model of another project is no Tinker run.
    made = await live.client.post(
        "/v1/models", json={"name": "plain", "base_model": str(tiny_model), "backend": "cpu"}
    )
    assert made.status_code == 201, made.text
    plain = await live.client.get("/v1/models/plain/tinker-metrics")
    assert plain.status_code == 404 and "no Tinker training run" in plain.json()["detail"]
