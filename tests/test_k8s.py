"""The Kubernetes manifests (deploy/k8s), checked offline.

No cluster runs here, so nothing is applied. Instead every overlay is rendered with the
real `kubectl kustomize`, every object is validated against Kubernetes' own schemas
(`kubernetes-validate`, strict: an unknown field fails) and the custom resources against
their projects' published CRD schemas (vendored in deploy/k8s/schemas, made strict the same
way), and the objects are checked against each other and against the code they run (the
settings class, the probes' paths, the secrets they name). Each KEDA ScaledObject's query runs
against the real Postgres, with jobs in several pools and states.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import text

from app.db import create_engine
from app.models import JobRow, ModelRow
from app.settings import Settings
from tests.conftest import POSTGRES_URL, recreate_postgres, run_apart

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-only", "gpu")
SCHEMAS = K8S / "schemas"
# The Kubernetes versions the manifests must be valid for: an old supported one and the
# newest kubernetes-validate knows.
KUBE_VERSIONS = ("1.30", "1.37")
CUSTOM_KINDS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "keda.sh_triggerauthentications.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}
ARRIVING_SETTINGS: set[str] = set()  # settings the manifests name before the code has them
# A drain finishes (or hands back) the jobs a worker runs: a whole step must fit.
MIN_DRAIN_SECONDS = 600


def kubectl() -> str:
    """kubectl's path; skipped (with the reason) only outside CI when it is missing."""
    path = shutil.which("kubectl")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl is missing under CI (.ci/run installs Debian's kubernetes-client)")
        pytest.skip("kubectl is not installed (Debian: apt-get install kubernetes-client)")
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def of_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def workers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        name: d
        for name, d in of_kind(objects, "Deployment").items()
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    }


def option(command: list[str], name: str) -> str:
    assert command.count(name) == 1, (name, command)
    return command[command.index(name) + 1]


# --------------------------------------------------------------------------- rendering


def test_every_overlay_renders_what_it_promises(rendered: dict[str, list[dict[str, Any]]]) -> None:
    common = {
        ("Namespace", "trainyard"),
        ("Secret", "trainyard-database"),
        ("Secret", "trainyard-api-keys"),
        ("Secret", "trainyard-object-store"),
        ("ConfigMap", "trainyard-config"),
        ("Deployment", "trainyard-api"),
        ("Service", "trainyard-api"),
        ("PodDisruptionBudget", "trainyard-api"),
        ("HorizontalPodAutoscaler", "trainyard-api"),
        ("ServiceMonitor", "trainyard-api"),
        ("TriggerAuthentication", "trainyard-postgres"),
        ("Deployment", "trainyard-worker-default"),
        ("ScaledObject", "trainyard-worker-default"),
    }
    gpu_only = {
        ("Deployment", "trainyard-worker-gpu"),
        ("ScaledObject", "trainyard-worker-gpu"),
        ("Deployment", "serving-qwen2-5-0-5b"),
        ("Service", "serving-qwen2-5-0-5b"),
    }
    for overlay, objects in rendered.items():
        names = [(o["kind"], o["metadata"]["name"]) for o in objects]
        assert len(names) == len(set(names)), f"{overlay}: an object twice"
        expected = common | (gpu_only if overlay == "gpu" else set())
        assert set(names) == expected, overlay
        for o in objects:
            if o["kind"] != "Namespace":
                assert o["metadata"].get("namespace") == "trainyard", (overlay, o["kind"])


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_validate_against_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    import kubernetes_validate

    built_in = [o for o in rendered[overlay] if (o["apiVersion"], o["kind"]) not in CUSTOM_KINDS]
    assert built_in
    for version in KUBE_VERSIONS:
        for o in built_in:
            kubernetes_validate.validate(o, version, strict=True)


def test_the_kubernetes_validation_catches_a_wrong_field(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    import kubernetes_validate

    api = copy.deepcopy(of_kind(rendered["cpu-only"], "Deployment")["trainyard-api"])
    pod_spec(api)["terminationGracePeriod"] = 30  # the field is terminationGracePeriodSeconds
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, KUBE_VERSIONS[-1], strict=True)
    api = copy.deepcopy(of_kind(rendered["cpu-only"], "Deployment")["trainyard-api"])
    pod_spec(api)["containers"][0]["resources"]["limits"]["memory"] = ["2Gi"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, KUBE_VERSIONS[-1], strict=True)


def strict(schema: Any) -> Any:
    """A CRD's openAPIV3Schema with unknown fields refused: every object schema that lists
    its properties, and keeps no unknown fields, gets `additionalProperties: false` (the API
    server would silently prune such a field, so a typo would change nothing, unseen)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(api_version: str, kind: str) -> Any:
    import jsonschema

    crd = yaml.safe_load((SCHEMAS / CUSTOM_KINDS[(api_version, kind)]).read_text())
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"], f"{api_version} {kind} is not served"
    schema = strict(served["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_validate_against_their_crds(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    custom = [o for o in rendered[overlay] if (o["apiVersion"], o["kind"]) in CUSTOM_KINDS]
    kinds = {o["kind"] for o in custom}
    assert kinds == {"ScaledObject", "TriggerAuthentication", "ServiceMonitor"}
    for o in custom:
        errors = [e.message for e in crd_validator(o["apiVersion"], o["kind"]).iter_errors(o)]
        assert errors == [], (o["kind"], o["metadata"]["name"], errors)


def test_the_crd_validation_catches_a_wrong_field(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    scaled = copy.deepcopy(of_kind(rendered["gpu"], "ScaledObject")["trainyard-worker-gpu"])
    validator = crd_validator(scaled["apiVersion"], scaled["kind"])
    assert validator.is_valid(scaled)
    scaled["spec"]["minReplicas"] = 0  # KEDA's field is minReplicaCount
    assert not validator.is_valid(scaled)
    scaled = copy.deepcopy(of_kind(rendered["gpu"], "ScaledObject")["trainyard-worker-gpu"])
    del scaled["spec"]["scaleTargetRef"]["name"]
    assert not validator.is_valid(scaled)


# --------------------------------------------------------------------------- consistency


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_and_config_reference_resolves(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objects = rendered[overlay]
    secrets = of_kind(objects, "Secret")
    config_maps = of_kind(objects, "ConfigMap")
    for d in of_kind(objects, "Deployment").values():
        for c in containers(d):
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], (c["name"], e)
    for auth in of_kind(objects, "TriggerAuthentication").values():
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in secrets[ref["name"]]["stringData"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_trainyard_variable_is_a_setting(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    known = {f"TRAINYARD_{name.upper()}" for name in Settings.model_fields} | ARRIVING_SETTINGS
    names = set()
    for d in of_kind(rendered[overlay], "Deployment").values():
        for c in containers(d):
            names |= {n for n in env_of(c) if n.startswith("TRAINYARD_")}
    for cm in of_kind(rendered[overlay], "ConfigMap").values():
        names |= {n for n in cm["data"] if n.startswith("TRAINYARD_")}
    assert names
    assert names <= known, names - known
    for cm in of_kind(rendered[overlay], "ConfigMap").values():
        settings = {k[len("TRAINYARD_") :].lower(): v for k, v in cm["data"].items()}
        Settings(**{k: v for k, v in settings.items() if k in Settings.model_fields})


def test_api_deployment(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["cpu-only"]
    api = of_kind(objects, "Deployment")["trainyard-api"]
    spec = pod_spec(api)
    (migrate,) = spec["initContainers"]
    assert migrate["command"] == ["trainyard", "migrate"]
    (container,) = spec["containers"]
    assert container["command"][:2] == ["trainyard", "serve"]
    assert option(container["command"], "--port") == "8000"
    assert env_of(container)["TRAINYARD_WORKER_ENABLED"]["value"] == "false"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]
    config = of_kind(objects, "ConfigMap")["trainyard-config"]["data"]
    assert config["TRAINYARD_MIGRATE_ON_START"] == "false", "the init container migrates"

    labels = api["spec"]["template"]["metadata"]["labels"]
    service = of_kind(objects, "Service")["trainyard-api"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    pdb = of_kind(objects, "PodDisruptionBudget")["trainyard-api"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = of_kind(objects, "HorizontalPodAutoscaler")["trainyard-api"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "trainyard-api",
    }
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["minAvailable"]
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert "replicas" not in api["spec"], "the HPA owns the replica count"

    monitor = of_kind(objects, "ServiceMonitor")["trainyard-api"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    # It scrapes with the metrics key the API reads from the same Secret.
    token = endpoint["authorization"]["credentials"]
    assert endpoint["authorization"]["type"] == "Bearer"
    env = {e["name"]: e for e in api["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TRAINYARD_METRICS_KEYS"]["valueFrom"]["secretKeyRef"] == token
    secret = of_kind(objects, "Secret")[token["name"]]
    assert token["key"] in secret["stringData"]


async def test_probed_paths_are_served_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probes reach the API without an API key; the scrape with its metrics key."""
    import httpx

    from app.main import create_app

    monkeypatch.setenv("TRAINYARD_API_KEYS", "secret-key")
    monkeypatch.setenv("TRAINYARD_METRICS_KEYS", "scrape-key")
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'trainyard.db'}",
        data_dir=tmp_path,
        worker_enabled=False,
    )
    app = create_app(settings)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client,
    ):
        for path in ("/healthz", "/readyz"):
            assert (await client.get(path)).status_code == 200, path
        assert (await client.get("/metrics")).status_code == 401
        scrape = {"Authorization": "Bearer scrape-key"}
        assert (await client.get("/metrics", headers=scrape)).status_code == 200
        assert (await client.get("/v1/models")).status_code == 401


def test_worker_pools(rendered: dict[str, list[dict[str, Any]]]) -> None:
    pools: dict[str, dict[str, Any]] = {}
    for overlay, objects in rendered.items():
        scaled = {
            s["spec"]["scaleTargetRef"]["name"]: s
            for s in of_kind(objects, "ScaledObject").values()
        }
        for name, worker in workers(objects).items():
            (container,) = pod_spec(worker)["containers"]
            command = container["command"]
            assert command[:2] == ["trainyard", "worker"], command
            pool = option(command, "--pool")
            assert worker["metadata"]["labels"]["trainyard.dev/pool"] == pool
            assert option(command, "--backends")
            assert pod_spec(worker)["terminationGracePeriodSeconds"] >= MIN_DRAIN_SECONDS
            assert pod_spec(worker)["initContainers"][0]["command"] == ["trainyard", "migrate"]
            assert "replicas" not in worker["spec"], "KEDA owns the replica count"
            assert name in scaled, f"{overlay}: no ScaledObject for {name}"
            pools[pool] = {"worker": worker, "scaled": scaled[name], "container": container}
    assert set(pools) == {"default", "gpu"}

    default = pools["default"]
    assert option(default["container"]["command"], "--backends") == "cpu"
    assert "nvidia.com/gpu" not in default["container"]["resources"]["limits"]
    assert default["scaled"]["spec"]["minReplicaCount"] >= 1

    gpu = pools["gpu"]
    command = gpu["container"]["command"]
    assert "art-local" in option(command, "--backends").split(",")
    assert option(command, "--labels") == "gpu=h200"
    resources = gpu["container"]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1
    spec = pod_spec(gpu["worker"])
    # Placed on the GPU class its label names.
    assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert gpu["scaled"]["spec"]["minReplicaCount"] == 0, "GPU pools scale to zero"
    # A GPU step (and a drain) takes longer than a cpu one.
    assert (
        spec["terminationGracePeriodSeconds"]
        > pod_spec(default["worker"])["terminationGracePeriodSeconds"]
    )


def test_worker_commands_parse_with_the_cli(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Each worker's command line, parsed by click exactly as `trainyard` would."""
    import typer

    from app.cli import app as cli

    command = typer.main.get_command(cli)
    worker = command.commands["worker"]  # type: ignore[attr-defined]
    if "pool" not in {p.name for p in worker.params}:
        pytest.skip("`trainyard worker` has no --pool yet (worker pools, issue 26)")
    for objects in rendered.values():
        for deployment in workers(objects).values():
            (container,) = pod_spec(deployment)["containers"]
            ctx = worker.make_context("worker", list(container["command"][2:]))
            assert ctx.params["pool"] == option(container["command"], "--pool")


def test_serving_pool_runs_vllm_with_lora(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["gpu"]
    serving = of_kind(objects, "Deployment")["serving-qwen2-5-0-5b"]
    (container,) = pod_spec(serving)["containers"]
    command = container["command"]
    assert command[:2] == ["vllm", "serve"]
    flags = dict(arg.split("=", 1) if "=" in arg else (arg, "") for arg in command[3:])
    assert "--enable-lora" in flags
    assert int(flags["--max-lora-rank"]) >= 16
    assert int(flags["--max-cpu-loras"]) >= int(flags["--max-loras"]) >= 1
    assert env_of(container)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "True"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    service = of_kind(objects, "Service")["serving-qwen2-5-0-5b"]
    assert (
        service["spec"]["selector"].items()
        <= serving["spec"]["template"]["metadata"]["labels"].items()
    )


def test_scaled_objects_use_the_postgres_scaler(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["gpu"]
    auths = of_kind(objects, "TriggerAuthentication")
    deployments = of_kind(objects, "Deployment")
    for scaled in of_kind(objects, "ScaledObject").values():
        assert scaled["spec"]["scaleTargetRef"]["name"] in deployments
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "postgresql"
        assert trigger["authenticationRef"]["name"] in auths
        assert float(trigger["metadata"]["targetQueryValue"]) >= 1
        assert "connection" not in trigger["metadata"], "the connection is a secret"
    (auth,) = auths.values()
    assert [r["parameter"] for r in auth["spec"]["secretTargetRef"]] == ["connection"]


# --------------------------------------------------------------------------- KEDA's query


def pool_queries(objects: list[dict[str, Any]]) -> dict[str, str]:
    """Each pool's KEDA query, by the `--pool` of the Deployment it scales."""
    deployments = of_kind(objects, "Deployment")
    out = {}
    for scaled in of_kind(objects, "ScaledObject").values():
        (container,) = pod_spec(deployments[scaled["spec"]["scaleTargetRef"]["name"]])["containers"]
        (trigger,) = scaled["spec"]["triggers"]
        out[option(container["command"], "--pool")] = trigger["metadata"]["query"]
    return out


@pytest.fixture
def keda_database(postgres_template: str) -> Iterator[str]:
    assert POSTGRES_URL
    run_apart(recreate_postgres(POSTGRES_URL, postgres_template))
    yield POSTGRES_URL


# (pool of the model, or None: no pool set), kind, status, how many jobs.
SEEDED = [
    (None, "training", "queued", 2),
    (None, "rollout", "running", 1),
    (None, "training", "succeeded", 3),
    ("default", "training", "queued", 1),
    ("default", "run", "running", 1),
    ("gpu", "training", "queued", 3),
    ("gpu", "rollout", "queued", 1),
    ("gpu", "training", "running", 1),
    ("gpu", "rollout", "running", 1),
    ("gpu", "run", "queued", 2),
    ("gpu", "training", "failed", 2),
    ("gpu", "training", "cancelled", 1),
    ("h100", "training", "queued", 4),
    ("h100", "training", "running", 1),
]


def expected_count(pool: str) -> int:
    return sum(
        n
        for model_pool, kind, status, n in SEEDED
        if (model_pool or "default") == pool and kind != "run" and status in {"queued", "running"}
    )


@pytest.mark.postgres
@pytest.mark.skipif(
    not POSTGRES_URL, reason="needs TRAINYARD_TEST_DATABASE_URL (a Postgres server)"
)
async def test_keda_queries_count_their_pools_jobs_on_postgres(
    rendered: dict[str, list[dict[str, Any]]], keda_database: str
) -> None:
    queries = pool_queries(rendered["gpu"])
    assert set(queries) == {"default", "gpu"}
    assert pool_queries(rendered["cpu-only"]) == {"default": queries["default"]}
    engine = create_engine(keda_database)
    try:
        async with engine.begin() as conn:
            seq = 0
            for i, (pool, kind, status, n) in enumerate(SEEDED):
                for j in range(n):
                    # One model per job: the database allows one running job per model.
                    model = f"m{i}-{j}"
                    await conn.execute(
                        ModelRow.__table__.insert().values(
                            name=model, project="p", base_model="b", backend="cpu"
                        )
                    )
                    await conn.execute(
                        text("UPDATE models SET pool = :pool WHERE name = :name"),
                        {"pool": pool, "name": model},
                    )
                    seq += 1
                    await conn.execute(
                        JobRow.__table__.insert().values(
                            id=f"job-{seq}",
                            kind=kind,
                            model_name=model,
                            status=status,
                            payload=b"",
                            payload_format="none",
                            payload_bytes=0,
                            request_hash="0" * 64,
                            max_attempts=3,
                        )
                    )
        counts = {}
        async with engine.connect() as conn:
            for pool, query in queries.items():
                # Exactly the text KEDA sends.
                counts[pool] = (await conn.exec_driver_sql(query)).scalar_one()
    finally:
        await engine.dispose()
    assert counts == {"default": expected_count("default"), "gpu": expected_count("gpu")}
    assert counts == {"default": 4, "gpu": 6}


# --------------------------------------------------------------------------- README


def readme_overlay() -> tuple[str, str]:
    """The README's own overlay (Deploy, step 3): its kustomization and its secrets."""
    section = (ROOT / "README.md").read_text().split("\n### Kubernetes\n", 1)[1]
    section = section.split("\n### ", 1)[0]
    blocks = [textwrap.dedent(b) for b in re.findall(r"```yaml\n(.*?)\n\s*```", section, re.S)]
    kustomization, secrets = blocks
    return kustomization, secrets


def test_the_readme_overlay_renders_and_replaces_images_and_secrets(tmp_path: Path) -> None:
    kustomization, secrets = readme_overlay()
    (tmp_path / "trainyard").symlink_to(ROOT)
    fleet = tmp_path / "my-fleet"
    fleet.mkdir()
    (fleet / "kustomization.yaml").write_text(kustomization)
    (fleet / "secrets.yaml").write_text(secrets)
    done = subprocess.run(
        [kubectl(), "kustomize", str(fleet)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    objects = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    assert {(o["kind"], o["metadata"]["name"]) for o in objects} == {
        (o["kind"], o["metadata"]["name"]) for o in render("gpu")
    }
    images = {
        c["image"]
        for d in of_kind(objects, "Deployment").values()
        if d["metadata"]["labels"].get("app.kubernetes.io/component") != "serving"
        for c in containers(d)
    }
    assert images == {
        "registry.example.com/trainyard:1.0",
        "registry.example.com/trainyard-gpu:1.0",
    }
    written = {s["metadata"]["name"]: s for s in yaml.safe_load_all(secrets)}
    rendered_secrets = of_kind(objects, "Secret")
    assert set(written) == set(rendered_secrets)
    for name, secret in written.items():
        assert rendered_secrets[name]["stringData"] == secret["stringData"], name
        assert "CHANGE-ME" not in json.dumps(rendered_secrets[name])


def same_database(trainyard_url: str, keda_url: str) -> bool:
    """Whether the SQLAlchemy URL Trainyard uses and the libpq URL KEDA uses name one
    database (host, port, database, user)."""
    from sqlalchemy.engine import make_url

    ours, theirs = make_url(trainyard_url), make_url(keda_url)
    assert ours.drivername == "postgresql+asyncpg" and theirs.drivername == "postgresql"
    fields = ("host", "port", "database", "username")
    return all(getattr(ours, f) == getattr(theirs, f) for f in fields)


def test_keda_watches_the_database_trainyard_uses() -> None:
    secrets = of_kind(render("cpu-only"), "Secret")["trainyard-database"]["stringData"]
    assert same_database(secrets["database-url"], secrets["keda-connection"])
    _, readme = readme_overlay()
    written = {s["metadata"]["name"]: s for s in yaml.safe_load_all(readme)}
    data = written["trainyard-database"]["stringData"]
    assert same_database(data["database-url"], data["keda-connection"])
    assert not same_database(data["database-url"], data["keda-connection"].replace("5432", "5433"))
