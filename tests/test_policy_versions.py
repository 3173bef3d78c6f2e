"""Policy versions, what a job trained, and reading a training job back: real HTTP, a
real database, a real worker, the dry-run backend where the GPU would be."""

from __future__ import annotations

import pytest

from tests import factories as f
from tests.backends import RecordingBackend, wait_final


@pytest.fixture
def recorder(tmp_path) -> RecordingBackend:
    return RecordingBackend(tmp_path / "recorder")


@pytest.fixture
async def live(serve, recorder):
    async with serve(worker_enabled=True, backend_overrides={"dry-run": recorder}) as server:
        await f.create_model(server.client)
        yield server


async def _train(live, **body) -> dict:
    response = await f.submit(live.client, **body)
    assert response.status_code == 202, response.text
    return await wait_final(live.client, response.json()["id"])


async def test_a_job_staler_than_it_allows_fails_at_claim_naming_both_steps(live, recorder) -> None:
    first = await _train(live, policy_step=0, max_steps_off_policy=0)
    assert first["status"] == "succeeded" and first["policy_step"] == 0
    assert first["max_steps_off_policy"] == 0
    # The model is at step 1 now: data sampled from step 0 is one step off-policy.
    stale = await _train(live, policy_step=0, max_steps_off_policy=0)
    assert stale["status"] == "failed" and stale["attempts"] == 1
    error = stale["error"]
    assert (error["type"], error["transient"]) == ("StalePolicy", False)
    assert "sampled from step 0" in error["message"]
    assert "at step 1" in error["message"] and "max_steps_off_policy is 0" in error["message"]
    events = (await live.client.get(f"/v1/training-jobs/{stale['id']}/events")).json()["data"]
    failed = events[-1]
    assert failed["type"] == "training_failed"
    assert (failed["data"]["policy_step"], failed["data"]["model_step"]) == (0, 1)
    # One step off is allowed when the job says so; untagged data is never refused.
    assert (await _train(live, policy_step=0, max_steps_off_policy=1))["status"] == "succeeded"
    assert (await _train(live))["status"] == "succeeded"
    future = await _train(live, policy_step=99)
    assert future["status"] == "failed" and "never existed" in future["error"]["message"]
    assert len(recorder.calls) == 3  # the refused jobs never reached the trainer


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        ({"max_steps_off_policy": 1}, ""),
        ({"policy_step": -1}, "policy_step"),
        ({"policy_step": 0, "max_steps_off_policy": "1"}, "max_steps_off_policy"),
    ],
)
async def test_bad_policy_fields_are_422(live, extra, path) -> None:
    response = await f.submit(live.client, **extra)
    assert response.status_code == 422, response.text
    [error] = response.json()["errors"]
    assert (error["location"], error["path"]) == ("body", path)
    assert (await live.client.get("/v1/training-jobs")).json()["data"] == []


async def test_a_job_with_nothing_to_learn_says_it_did_not_train(live) -> None:
    flat = await _train(live, collection=f.nat_collection([[0.5, 0.5], [1.0]]))
    assert flat["status"] == "succeeded"
    assert flat["result"]["final_step"] == 1  # the step counts, as in ART
    assert flat["result"]["trained"] is False
    assert "no group was trainable" in flat["result"]["reason"]
    learned = await _train(live)
    assert (learned["result"]["trained"], learned["result"]["reason"]) == (True, None)


async def test_a_training_job_reads_back_in_art_and_nat_shape(live) -> None:
    collection = f.nat_collection([[1.0, 0.0]])
    job = await _train(live, collection=collection)
    url = f"/v1/training-jobs/{job['id']}/trajectories"
    art = (await live.client.get(url)).json()
    [group] = art["groups"]
    assert [t["reward"] for t in group["trajectories"]] == [1.0, 0.0]
    choice = group["trajectories"][0]["messages_and_choices"][-1]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "4"
    nat = (await live.client.get(url, params={"shape": "nat"})).json()
    assert nat["run_id"] == job["id"]
    sent, back = collection["trajectories"][0][0]["episode"], nat["trajectories"][0][0]["episode"]
    assert [(i["role"], i["content"]) for i in back] == [(i["role"], i["content"]) for i in sent]
    assert (
        back[-1]["logprobs"]["content"][0]["token"] == sent[-1]["logprobs"]["content"][0]["token"]
    )
    groups = f.art_groups([[0.0, 1.0]])
    art_job = await _train(live, groups=groups)
    again = (await live.client.get(f"/v1/training-jobs/{art_job['id']}/trajectories")).json()
    sent_items = groups[0]["trajectories"][1]["messages_and_choices"]
    assert again["groups"][0]["trajectories"][1]["messages_and_choices"] == sent_items
    assert (await live.client.get(url, params={"shape": "csv"})).status_code == 422
    missing = await live.client.get("/v1/training-jobs/job_nope/trajectories")
    assert missing.status_code == 404


async def test_job_lists_filter_on_metadata(live) -> None:
    a = await f.submit(live.client, metadata={"experiment": "a", "seed": "1"})
    b = await f.submit(live.client, metadata={"experiment": "b", "seed": "1"})
    seven = await f.submit(live.client, metadata={"experiment": 7})
    ids = {"a": a.json()["id"], "b": b.json()["id"], "7": seven.json()["id"]}

    async def listed(**params: str) -> list[str]:
        response = await live.client.get("/v1/training-jobs", params=params)
        assert response.status_code == 200, response.text
        return [job["id"] for job in response.json()["data"]]

    assert await listed(**{"metadata.experiment": "a"}) == [ids["a"]]
    assert await listed(**{"metadata.seed": "1"}) == [ids["b"], ids["a"]]
    assert await listed(**{"metadata.seed": "1", "metadata.experiment": "b"}) == [ids["b"]]
    assert await listed(**{"metadata.experiment": "c"}) == []
    assert await listed(**{"metadata.experiment": "7"}) == [ids["7"]]  # a number's text
    assert await listed(**{"metadata.missing": "x"}) == []
    bad = await live.client.get("/v1/training-jobs", params={"metadata.": "x"})
    assert bad.status_code == 422, bad.text
    [error] = bad.json()["errors"]
    assert (error["location"], error["path"]) == ("query", "metadata.")
    rollouts = await live.client.get("/v1/rollout-jobs", params={"metadata.experiment": "a"})
    assert rollouts.status_code == 200 and rollouts.json()["data"] == []
