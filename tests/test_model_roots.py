"""A cpu model's `base_model` is a path on the server: only directories under the data
directory and TRAINYARD_MODEL_ROOTS are accepted, symlinks resolved, and neither the
refusal nor a job's error says whether a path elsewhere exists."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.models import ModelRow
from tests import factories as f
from tests.backends import wait_final

pytestmark = pytest.mark.any_database


@pytest.fixture
def disk(tmp_path: Path) -> dict[str, Path]:
    """A model root with a model, a secret directory outside it, and symlinks both ways."""
    root, outside = tmp_path / "models", tmp_path / "outside"
    (root / "m").mkdir(parents=True)
    (outside / "secret").mkdir(parents=True)
    (outside / "file").write_text("x")
    os.symlink(outside / "secret", root / "link-out")
    os.symlink("/etc", root / "link-etc")
    os.symlink(root / "m", root / "link-in")
    os.symlink(root / "m", outside / "link-to-root")
    os.symlink(root / "loop", root / "loop")
    return {"root": root, "outside": outside, "data": tmp_path / "data"}


def cpu_body(base: str, name: str = "m") -> dict[str, str]:
    return {"name": name, "project": "tests", "base_model": base, "backend": "cpu"}


def fill(template: str, disk: dict[str, Path]) -> str:
    return template.format(**{k: str(v) for k, v in disk.items()})


REFUSED = [
    "/etc",
    "/",
    "/proc/self",
    "/proc/self/root/etc",
    "//etc",
    "..",
    "../..",
    "relative/dir",
    "m",
    "./m",
    "~/models",
    "{root}/../outside/secret",
    "{root}/./../outside",
    "/etc/../{root}/m",
    "{root}/m/..",
    "{root}/link-out",
    "{root}/link-out/../secret",
    "{root}/link-etc",
    "{root}/link-etc/ssl",
    "{root}/loop",
    "{outside}/secret",
    "{outside}/link-to-root",
    "{root}x",  # a sibling whose name starts like the root's
]


@pytest.mark.parametrize("base", REFUSED)
async def test_a_cpu_model_outside_the_roots_is_refused_and_nothing_is_stored(
    serve, disk, base
) -> None:
    async with serve(model_roots=[disk["root"]], data_dir=disk["data"]) as live:
        response = await live.client.post("/v1/models", json=cpu_body(fill(base, disk)))
        listed = await live.client.get("/v1/models")
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    [error] = response.json()["errors"]
    assert (error["location"], error["path"]) == ("body", "base_model")
    assert str(disk["root"]) in error["message"]
    assert str(disk["data"].absolute()) in error["message"]
    assert listed.json()["data"] == []


@pytest.mark.parametrize(
    ("exists", "missing"),
    [
        ("/etc", "/no-such-directory-here"),
        ("/etc/passwd", "/etc/no-such-file"),
        ("/proc/self", "/proc/none"),
        ("{outside}/secret", "{outside}/missing"),
        ("{outside}/file", "{outside}/missing"),
    ],
)
async def test_the_refusal_says_nothing_about_what_exists(serve, disk, exists, missing) -> None:
    async with serve(model_roots=[disk["root"]], data_dir=disk["data"]) as live:
        there = await live.client.post("/v1/models", json=cpu_body(fill(exists, disk)))
        not_there = await live.client.post("/v1/models", json=cpu_body(fill(missing, disk)))
    assert there.status_code == not_there.status_code == 422
    assert there.json() == not_there.json()


@pytest.mark.parametrize(
    "base", ["{root}/m", "{root}/not-made-yet", "{root}/link-in", "{root}", "{data}/tiny-model"]
)
async def test_a_cpu_model_under_a_root_or_the_data_dir_is_accepted(serve, disk, base) -> None:
    async with serve(model_roots=[disk["root"]], data_dir=disk["data"]) as live:
        response = await live.client.post("/v1/models", json=cpu_body(fill(base, disk)))
    assert response.status_code == 201, response.text


@pytest.mark.parametrize("where", ["{root}/adapter", "{data}/my-adapter"])
async def test_a_lora_adapter_is_no_base_model(serve, disk, where) -> None:
    """Under a root or the data directory, a directory holding a LoRA adapter is refused
    as a base: transformers with PEFT would load it as a model, its base with the adapter
    applied."""
    adapter = Path(fill(where, disk))
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "/m"}')
    os.symlink(adapter, disk["root"] / "link-adapter")
    async with serve(model_roots=[disk["root"]], data_dir=disk["data"]) as live:
        for base in (str(adapter), str(disk["root"] / "link-adapter")):
            response = await live.client.post("/v1/models", json=cpu_body(base))
            assert response.status_code == 422, response.text
            [error] = response.json()["errors"]
            assert error["path"] == "base_model" and "LoRA adapter" in error["message"]
        assert (await live.client.get("/v1/models")).json()["data"] == []


async def test_checkpoint_storage_is_no_base_model_and_its_refusal_says_nothing(
    serve, disk
) -> None:
    """Checkpoint storage under the data directory holds every project's trained weights:
    any path in it is refused by its shape, an adapter that is there as one that is not,
    so another project's steps cannot be found out (or loaded) through `base_model`."""
    step = disk["data"] / "cpu" / "other" / "models" / "x" / "checkpoints" / "0001"
    step.mkdir(parents=True)
    (step / "adapter_config.json").write_text('{"base_model_name_or_path": "/m"}')
    os.symlink(step, disk["root"] / "link-step")
    checkpoints = step.parent
    paths = [step, checkpoints / "0002", checkpoints / "1", disk["root"] / "link-step"]
    paths += [disk["data"] / "checkpoint-cache" / "cpu" / "m"]
    async with serve(model_roots=[disk["root"]], data_dir=disk["data"]) as live:
        answers = [await live.client.post("/v1/models", json=cpu_body(str(path))) for path in paths]
        listed = (await live.client.get("/v1/models")).json()["data"]
    assert {a.status_code for a in answers} == {422}
    assert len({a.json()["errors"][0]["message"] for a in answers}) == 1
    assert "inside checkpoint storage" in answers[0].json()["errors"][0]["message"]
    assert listed == []


async def test_other_backends_take_model_ids_as_before(serve) -> None:
    async with serve() as live:
        response = await live.client.post("/v1/models", json=f.model_body())
    assert response.status_code == 201  # "tiny/base" on dry-run: an id, not a path


def test_model_roots_setting_parses_comma_lists(tmp_path) -> None:
    from app.settings import Settings

    settings = Settings(model_roots=f" {tmp_path}/a, ,{tmp_path}/b ", data_dir=tmp_path / "d")
    assert settings.allowed_model_roots() == [tmp_path / "d", tmp_path / "a", tmp_path / "b"]


# ---------------------------------------------------------------------------------------------
# The backend checks again when it loads: rows from before the check, symlinks swapped since
# ---------------------------------------------------------------------------------------------


async def _failed_job_error(live, base: str, name: str) -> str:
    async with live.app.state.sessions() as session:
        session.add(ModelRow(name=name, project="tests", base_model=base, backend="cpu"))
        await session.commit()
    job = (await f.submit(live.client, model=name)).json()
    done = await wait_final(live.client, job["id"])
    assert done["status"] == "failed", done
    return str(done["error"]["message"])


@pytest.mark.torch
async def test_a_stored_model_outside_the_roots_fails_alike_whether_it_exists(serve, disk) -> None:
    pairs = [("/etc", "/no-such-dir"), (str(disk["outside"] / "secret"), "/nope/x")]
    async with serve(worker_enabled=True, model_roots=[disk["root"]]) as live:
        for i, (exists, missing) in enumerate(pairs):
            there = await _failed_job_error(live, exists, f"there{i}")
            not_there = await _failed_job_error(live, missing, f"missing{i}")
            assert there.replace(exists, "P") == not_there.replace(missing, "P")
            assert "model roots" in there


@pytest.mark.torch
async def test_a_model_swapped_for_a_symlink_out_of_the_roots_is_not_loaded(disk) -> None:
    import art

    from app.backends.cpu import CpuBackend

    backend = CpuBackend(disk["data"] / "cpu", model_roots=[disk["root"]])
    base = disk["root"] / "swapped"
    os.symlink(disk["outside"] / "secret", base)  # registered as a directory, then swapped
    model = art.TrainableModel(name="s", project="tests", base_model=str(base))
    with pytest.raises(ValueError, match="model roots"):
        await backend.register(model)
    missing = art.TrainableModel(name="n", project="tests", base_model=str(disk["root"] / "n"))
    with pytest.raises(ValueError, match="not one"):  # inside a root: may say it is missing
        await backend.register(missing)
