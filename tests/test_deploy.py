"""Consistency checks of the deployment files against the code they deploy.

No Docker engine runs where the tests run, so nothing here builds an image. Instead the
compose file and the Dockerfiles are parsed and checked against the repository: the settings
class, the CLI (parsed with click, exactly as `trainyard` would parse the command), the
package extras, the paths the images copy and what `.dockerignore` leaves in the build
context. When a `docker-compose` binary or the `docker compose` plugin is on PATH, compose
itself validates the file too.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer
import yaml
from packaging.specifiers import SpecifierSet
from sqlalchemy.engine import make_url

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERIGNORE = ROOT / ".dockerignore"
CPU_DOCKERFILE = ROOT / "docker" / "Dockerfile"
GPU_DOCKERFILE = ROOT / "docker" / "Dockerfile.gpu"

POSTGRES = "postgres"
APP_SERVICES = ("api", "worker", "worker-gpu")
EXPECTED_SERVICES = {POSTGRES, *APP_SERVICES}
DATA_DIR = "/data"
API_PORT = 8000
# Files that may legitimately be left out of the build context although a COPY source
# directory contains them.
JUNK = re.compile(r"(^|/)(__pycache__|\.mypy_cache|\.pytest_cache|\.ruff_cache)(/|$)|\.py[cod]$")


# --------------------------------------------------------------------------- helpers


def load_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict), "docker-compose.yml is not a mapping"
    return data


def services() -> dict[str, dict[str, Any]]:
    result = load_compose().get("services")
    assert isinstance(result, dict), "docker-compose.yml has no services mapping"
    return result


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment as a dict of strings, from either compose syntax."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        pairs = (item.split("=", 1) if "=" in item else (item, "") for item in env)
        return {key: value for key, value in pairs}
    assert isinstance(env, dict), f"environment must be a mapping or a list, not {env!r}"
    return {key: "" if value is None else str(value) for key, value in env.items()}


def command_words(command: str | list[str] | None) -> list[str]:
    assert command, "no command"
    return shlex.split(command) if isinstance(command, str) else [str(w) for w in command]


def cli_group() -> Any:
    """The click group behind the typer app (typer may vendor its own click, so duck-type)."""
    from app.cli import app as cli_app

    group = typer.main.get_command(cli_app)
    assert isinstance(getattr(group, "commands", None), dict), (
        "the trainyard CLI is not a group of subcommands"
    )
    return group


def parse_cli(words: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse a `trainyard <subcommand> ...` command line the way the CLI would.

    Returns the subcommand and its parsed parameters; raises on unknown subcommands,
    unknown options and values of the wrong type.
    """
    assert words[0] == "trainyard", f"command {words} does not run the trainyard CLI"
    assert len(words) >= 2, f"command {words} names no subcommand"
    group = cli_group()
    name = words[1]
    assert name in group.commands, (
        f"`trainyard {name}` is not a CLI command; commands: {sorted(group.commands)}"
    )
    ctx = group.commands[name].make_context(f"trainyard {name}", list(words[2:]))
    return name, dict(ctx.params)


def settings_from_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Build Settings exactly as the service would, from this environment alone."""
    for key in list(os.environ):
        if key.upper().startswith("TRAINYARD_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings()


def assert_trainyard_vars_are_settings(env: dict[str, str], where: str) -> None:
    fields = set(Settings.model_fields)
    for key in env:
        if key.upper().startswith("TRAINYARD_"):
            suffix = key[len("TRAINYARD_") :].lower()
            assert suffix in fields, (
                f"{where}: {key} is not a Settings field (fields: {sorted(fields)})"
            )


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [rest for instr, rest in self.instructions if instr == instruction]


@dataclass
class Dockerfile:
    path: Path
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def all(self, instruction: str) -> list[str]:
        return [rest for stage in self.stages for rest in stage.args(instruction)]


def parse_dockerfile(path: Path) -> Dockerfile:
    """Split a Dockerfile into stages of (INSTRUCTION, arguments), ARGs substituted."""
    logical: list[str] = []
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, f"{path}: the last instruction ends with a line continuation"

    args: dict[str, str] = {}

    def substitute(text: str) -> str:
        def repl(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            return args.get(name, match.group(0))

        return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, text)

    stages: list[Stage] = []
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        rest = rest.strip()
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            if default or name not in args:
                args[name.strip()] = default.strip().strip('"')
            if not stages:
                continue
        if instruction == "FROM":
            words = [w for w in substitute(rest).split() if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
            continue
        assert stages, f"{path}: {instruction} before the first FROM"
        stages[-1].instructions.append((instruction, substitute(rest)))
    assert stages, f"{path}: no FROM"
    return Dockerfile(path=path, stages=stages)


def exec_form(rest: str) -> list[str]:
    try:
        words = json.loads(rest)
    except json.JSONDecodeError:
        pytest.fail(f"use the exec (JSON array) form, not the shell form: {rest}")
    assert isinstance(words, list) and all(isinstance(w, str) for w in words), rest
    return words


def env_of(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for rest in stage.args("ENV"):
        words = shlex.split(rest)
        if words and "=" not in words[0]:
            env[words[0]] = " ".join(words[1:])  # legacy `ENV KEY value`
            continue
        for word in words:
            key, _, value = word.partition("=")
            env[key] = value
    return env


def copy_sources(dockerfile: Dockerfile) -> list[str]:
    """Build-context paths of every COPY/ADD that does not copy from another stage/image."""
    sources: list[str] = []
    for stage in dockerfile.stages:
        for instruction, rest in stage.instructions:
            if instruction not in {"COPY", "ADD"}:
                continue
            words = exec_form(rest) if rest.startswith("[") else shlex.split(rest)
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            if any(flag.startswith("--from") for flag in flags):
                continue
            assert len(paths) >= 2, f"{dockerfile.path}: {instruction} {rest}"
            sources.extend(paths[:-1])
    return sources


def translate_ignore_pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as an anchored regex."""
    out = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif char == "*":
            out.append("[^/]*")
            i += 1
        elif char == "?":
            out.append("[^/]")
            i += 1
        elif char == "[":
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end]
            if body.startswith(("!", "^")):
                body = "^" + body[1:]
            out.append(f"[{body}]")
            i = end + 1
        else:
            out.append(re.escape(char))
            i += 1
    return re.compile("".join(out) + r"\Z")


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = posixpath.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((negate, translate_ignore_pattern(pattern)))
    return rules


def is_ignored(relpath: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether Docker leaves relpath out of the build context (last matching rule wins;
    a pattern that matches a parent directory matches everything under it)."""
    parts = relpath.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negate, regex in rules:
        if any(regex.match(candidate) for candidate in candidates):
            ignored = not negate
    return ignored


def image_layout(stage: Stage) -> dict[str, str]:
    """Where a stage's COPY instructions put build-context paths: image path -> repo path.

    A copied directory maps to its source directory (Docker copies its contents)."""
    layout: dict[str, str] = {}
    workdir = "/"
    for instruction, rest in stage.instructions:
        if instruction == "WORKDIR":
            workdir = posixpath.join(workdir, rest.strip())
            continue
        if instruction not in {"COPY", "ADD"}:
            continue
        words = exec_form(rest) if rest.startswith("[") else shlex.split(rest)
        if any(w.startswith("--from") for w in words):
            continue
        paths = [w for w in words if not w.startswith("--")]
        *sources, dest = paths
        dest_abs = posixpath.normpath(posixpath.join(workdir, dest))
        into_dir = dest.endswith("/") or len(sources) > 1
        for source in sources:
            relative = posixpath.normpath(source).lstrip("/")
            if (ROOT / relative).is_dir() or not into_dir:
                layout[dest_abs] = relative
            else:
                layout[posixpath.join(dest_abs, posixpath.basename(relative))] = relative
    return layout


def image_source(layout: dict[str, str], image_path: str) -> str | None:
    """The repo path that ends up at image_path, if any COPY puts something there."""
    image_path = posixpath.normpath(image_path)
    for dest, source in layout.items():
        if image_path == dest:
            return source
        if image_path.startswith(dest + "/") and (ROOT / source).is_dir():
            candidate = posixpath.join(source, image_path[len(dest) + 1 :])
            if (ROOT / candidate).exists():
                return candidate
    return None


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def installed_extras(dockerfile: Dockerfile) -> list[set[str]]:
    """The extras of every `pip install .[extras]` / `uv pip install` of the project."""
    installs = []
    for rest in dockerfile.all("RUN"):
        for command in re.split(r"&&|;|\|\|", rest):
            words = shlex.split(command)
            if "pip" not in words or "install" not in words:
                continue
            for word in words[words.index("install") + 1 :]:
                match = re.fullmatch(r"\.(?:\[([\w,\s-]*)\])?/?", word)
                if match:
                    extras = match.group(1) or ""
                    installs.append({e.strip() for e in extras.split(",") if e.strip()})
    return installs


# --------------------------------------------------------------------------- compose


def test_compose_has_the_four_services() -> None:
    assert set(services()) >= EXPECTED_SERVICES, (
        f"missing services: {sorted(EXPECTED_SERVICES - set(services()))}"
    )


def test_only_the_gpu_worker_is_behind_the_gpu_profile() -> None:
    svc = services()
    assert svc["worker-gpu"].get("profiles") == ["gpu"]
    for name in EXPECTED_SERVICES - {"worker-gpu"}:
        assert not svc[name].get("profiles"), f"{name} must start without a profile"


def test_gpu_worker_reserves_one_nvidia_gpu() -> None:
    devices = services()["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


@pytest.mark.parametrize("name", APP_SERVICES)
def test_build_context_and_dockerfile_exist(name: str) -> None:
    build = services()[name].get("build")
    assert isinstance(build, dict), f"{name} has no build section"
    context = (ROOT / build.get("context", ".")).resolve()
    assert context == ROOT, f"{name}: the build context must be the repository root"
    dockerfile = context / build.get("dockerfile", "Dockerfile")
    assert dockerfile.is_file(), f"{name}: build.dockerfile {dockerfile} does not exist"


def test_images_match_dockerfiles() -> None:
    svc = services()
    assert svc["api"]["build"]["dockerfile"] == "docker/Dockerfile"
    assert svc["worker"]["build"] == svc["api"]["build"], "api and worker use one image"
    assert svc["worker"].get("image") == svc["api"].get("image")
    assert svc["worker-gpu"]["build"]["dockerfile"] == "docker/Dockerfile.gpu"
    assert svc["worker-gpu"].get("image") != svc["api"].get("image"), (
        "the GPU image must not share a tag with the CPU image"
    )


@pytest.mark.parametrize("name", APP_SERVICES)
def test_environment_names_real_settings(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env = environment(services()[name])
    assert_trainyard_vars_are_settings(env, f"docker-compose.yml service {name}")
    assert env.get("LITELLM_LOCAL_MODEL_COST_MAP") == "True"
    settings = settings_from_env(env, monkeypatch)  # values must validate, too
    assert str(settings.data_dir) == DATA_DIR


@pytest.mark.parametrize("name", APP_SERVICES)
def test_database_url_points_at_the_postgres_service(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = services()
    env = environment(svc[name])
    assert "TRAINYARD_DATABASE_URL" in env, f"{name} has no TRAINYARD_DATABASE_URL"
    url = make_url(settings_from_env(env, monkeypatch).database_url)
    assert url.drivername == "postgresql+asyncpg"
    assert url.host == POSTGRES and url.host in svc
    assert (url.port or 5432) == 5432
    pg_env = environment(svc[POSTGRES])
    assert url.username == pg_env.get("POSTGRES_USER", "postgres")
    assert url.password == pg_env.get("POSTGRES_PASSWORD")
    assert url.database == pg_env.get("POSTGRES_DB", url.username)


def test_all_app_services_share_one_database() -> None:
    urls = {environment(services()[name])["TRAINYARD_DATABASE_URL"] for name in APP_SERVICES}
    assert len(urls) == 1, f"app services disagree on the database: {urls}"


def test_postgres_service() -> None:
    pg = services()[POSTGRES]
    assert str(pg.get("image", "")).split(":")[0] == "postgres"
    assert str(pg["image"]).split(":")[1].split(".")[0] == "16"
    check = " ".join(command_words(pg["healthcheck"]["test"]))
    assert "pg_isready" in check
    named = set(load_compose().get("volumes") or {})
    sources = {str(v).split(":")[0] for v in pg.get("volumes", [])}
    assert sources & named, "postgres data must live on a named volume"


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_services_wait_for_healthy_postgres(name: str) -> None:
    depends = services()[name].get("depends_on")
    assert isinstance(depends, dict), f"{name}: depends_on must use the long form"
    assert depends.get(POSTGRES, {}).get("condition") == "service_healthy"
    assert services()[POSTGRES].get("healthcheck"), "service_healthy needs a healthcheck"


@pytest.mark.parametrize("name", APP_SERVICES)
def test_commands_are_real_cli_commands(name: str) -> None:
    subcommand, _ = parse_cli(command_words(services()[name].get("command")))
    expected = "serve" if name == "api" else "worker"
    assert subcommand == expected


def test_cli_has_the_documented_commands() -> None:
    assert {"serve", "worker", "migrate", "openapi"} <= set(cli_group().commands)


def test_api_serves_on_the_published_and_probed_port(monkeypatch: pytest.MonkeyPatch) -> None:
    api = services()["api"]
    _, params = parse_cli(command_words(api["command"]))
    assert params.get("host") == "0.0.0.0", "the API must listen on all interfaces"
    assert int(params["port"]) == API_PORT

    targets = {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in api.get("ports", [])}
    assert targets == {API_PORT}, f"published container ports {targets} != {API_PORT}"

    probe = " ".join(command_words(api["healthcheck"]["test"]))
    urls = re.findall(r"https?://[^\s'\"]+", probe)
    assert urls, f"api healthcheck has no URL: {probe}"
    parts = urlsplit(urls[0])
    assert (parts.hostname, parts.port, parts.path) == ("127.0.0.1", API_PORT, "/healthz")
    for tool in ("curl", "wget"):
        if re.search(rf"\b{tool}\b", probe):
            assert tool in CPU_DOCKERFILE.read_text(), f"the image does not install {tool}"

    env = environment(api)
    assert settings_from_env(env, monkeypatch).worker_enabled is False, (
        "the API must not run jobs in-process; the worker services do"
    )


async def test_api_healthcheck_path_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probed path answers 200 without the app's lifespan (no database): a liveness
    check that needs the database would mark a healthy API unhealthy during outages."""
    import httpx

    from app.main import create_app

    api = services()["api"]
    probe = " ".join(command_words(api["healthcheck"]["test"]))
    path = urlsplit(re.findall(r"https?://[^\s'\"]+", probe)[0]).path
    service = create_app(settings_from_env(environment(api), monkeypatch))
    # An ASGI transport sends no lifespan events: the app is never started.
    transport = httpx.ASGITransport(app=service, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        response = await client.get(path)
    assert response.status_code == 200, (
        f"the api healthcheck probes {path}: {response.status_code} {response.text[:200]}"
    )


@pytest.mark.parametrize("name", APP_SERVICES)
def test_data_dir_is_a_volume(name: str) -> None:
    mounts = services()[name].get("volumes", [])
    targets = {str(v).split(":")[1] for v in mounts if ":" in str(v)}
    assert DATA_DIR in targets, f"{name}: {DATA_DIR} is not mounted"


@pytest.fixture(params=["default", "gpu"])
def compose_command(request: pytest.FixtureRequest) -> list[str]:
    if shutil.which("docker-compose"):
        base = ["docker-compose"]
    elif shutil.which("docker") and (
        subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        base = ["docker", "compose"]
    else:
        pytest.skip("neither `docker-compose` nor the `docker compose` plugin is on PATH")
    profile = ["--profile", request.param] if request.param != "default" else []
    return [*base, *profile, "-f", str(COMPOSE_FILE), "config", "-q"]


def test_docker_compose_config_validates(compose_command: list[str]) -> None:
    result = subprocess.run(compose_command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        f"{' '.join(compose_command)} failed:\n{result.stdout}{result.stderr}"
    )


# --------------------------------------------------------------------------- images


DOCKERFILES = [
    pytest.param(CPU_DOCKERFILE, id="Dockerfile"),
    pytest.param(GPU_DOCKERFILE, id="Dockerfile.gpu"),
]


def test_dockerignore_keeps_secrets_and_virtualenvs_out() -> None:
    rules = dockerignore_rules()
    for path in (
        ".git/config",
        ".venv/bin/python",
        ".venv-art/bin/python",
        ".venv-nat/bin/python",
        ".venv-tinker/bin/python",
        ".env",
        "app/__pycache__/x.cpython-311.pyc",
    ):
        assert is_ignored(path, rules), f".dockerignore lets {path} into the build context"


@pytest.mark.parametrize("path", DOCKERFILES)
def test_copy_sources_exist_and_are_in_the_build_context(path: Path) -> None:
    sources = copy_sources(parse_dockerfile(path))
    assert sources, f"{path.name} copies nothing"
    rules = dockerignore_rules()
    for source in sources:
        relative = posixpath.normpath(source).lstrip("/")
        assert not any(c in relative for c in "*?["), f"{path.name}: glob COPY {source}"
        target = ROOT / relative
        assert target.exists(), f"{path.name} copies {source}, which is not in the repository"
        assert not is_ignored(relative, rules), f".dockerignore excludes {source}"
        if target.is_dir():
            for file in target.rglob("*"):
                rel = file.relative_to(ROOT).as_posix()
                if file.is_file() and not JUNK.search(rel):
                    assert not is_ignored(rel, rules), f".dockerignore excludes {rel}"


@pytest.mark.parametrize("path", DOCKERFILES)
def test_images_copy_what_the_package_needs(path: Path) -> None:
    sources = {posixpath.normpath(s).lstrip("/") for s in copy_sources(parse_dockerfile(path))}
    required = {"pyproject.toml", "app", "migrations"}
    readme = pyproject()["project"].get("readme")
    if isinstance(readme, str):
        required.add(readme)  # setuptools reads it while building the wheel
    assert required <= sources, f"{path.name} does not copy {sorted(required - sources)}"


@pytest.mark.parametrize("path", DOCKERFILES)
def test_image_runtime_contract(path: Path) -> None:
    dockerfile = parse_dockerfile(path)
    final = dockerfile.final
    users = final.args("USER")
    assert users, f"{path.name}: the final stage runs as root"
    assert users[-1].split(":")[0] not in {"root", "0"}, f"{path.name}: USER {users[-1]}"

    exposed = {int(p.split("/")[0]) for rest in final.args("EXPOSE") for p in rest.split()}
    assert API_PORT in exposed

    volumes: set[str] = set()
    for rest in final.args("VOLUME"):
        volumes.update(exec_form(rest) if rest.startswith("[") else rest.split())
    assert DATA_DIR in volumes

    env = env_of(final)
    assert env.get("TRAINYARD_DATA_DIR") == DATA_DIR
    assert env.get("LITELLM_LOCAL_MODEL_COST_MAP") == "True"
    assert_trainyard_vars_are_settings(env, path.name)

    cmds = final.args("CMD")
    assert cmds, f"{path.name}: no CMD"
    subcommand, params = parse_cli(exec_form(cmds[-1]))
    assert subcommand == "serve"
    assert params.get("host") == "0.0.0.0" and int(params["port"]) == API_PORT


def test_trainyard_migrate_works_from_the_built_wheel(tmp_path: Path) -> None:
    """Images install the package from a wheel built from what they copy: it must hold
    every module of `app/`, the dashboard's static files and the whole Alembic tree
    (top-level `migrations/`, shipped as `app/migrations/`), and `trainyard migrate` must
    run from it alone, away from the source tree."""
    # Built from a copy of the image's build context (no stale build/ directory either).
    context = tmp_path / "context"
    for source in copy_sources(parse_dockerfile(CPU_DOCKERFILE)):
        relative = posixpath.normpath(source).lstrip("/")
        if (ROOT / relative).is_dir():
            junk = shutil.ignore_patterns("__pycache__", "*.py[cod]")
            shutil.copytree(ROOT / relative, context / relative, ignore=junk)
        else:
            (context / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / relative, context / relative)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(context),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("trainyard-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "app").rglob("*.py")}
    # The dashboard's page, scripts and styles: package data, served from the wheel.
    static = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "app" / "dashboard" / "static").iterdir()
        if p.is_file()
    }
    assert {"app/dashboard/static/index.html", "app/dashboard/static/app.js"} <= static
    tree = {
        "app/" + p.relative_to(ROOT).as_posix()
        for p in (ROOT / "migrations").rglob("*")
        if p.is_file() and not JUNK.search(p.as_posix())
    }
    revisions = {name for name in tree if name.startswith("app/migrations/versions/")}
    assert revisions, "no migration revisions found"
    assert {"app/migrations/env.py", "app/migrations/script.py.mako"} <= tree
    wanted = modules | static | tree
    assert wanted <= names, f"the wheel lacks {sorted(wanted - names)}"

    # Installed as pip installs it: unpacked onto the path, ahead of the editable checkout.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    database = tmp_path / "wheel.db"
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "TRAINYARD_DATABASE_URL": f"sqlite+aiosqlite:///{database}",
        "TRAINYARD_DATA_DIR": str(tmp_path / "data"),
    }
    migrate = (
        "import sys, app.migrate; print(app.migrate.SCRIPT_LOCATION);"
        "sys.argv = ['trainyard', 'migrate']; from app.cli import main; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", migrate], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    location, said = done.stdout.strip().splitlines()
    assert Path(location) == site / "app" / "migrations"
    assert said == "database at head"
    from app.migrate import head_revision

    with sqlite3.connect(database) as conn:
        (version,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert version == head_revision()


def python_version_satisfies_project(version: str) -> None:
    spec = SpecifierSet(pyproject()["project"]["requires-python"])
    assert spec.contains(version), f"Python {version} does not satisfy {spec}"


def test_cpu_image_base_and_install() -> None:
    dockerfile = parse_dockerfile(CPU_DOCKERFILE)
    for stage in dockerfile.stages:
        match = re.fullmatch(r"python:(\d+\.\d+)[\w.-]*-slim[\w.-]*", stage.base)
        if stage.base in {s.name for s in dockerfile.stages}:
            continue
        assert match, f"unexpected base image {stage.base}"
        python_version_satisfies_project(match.group(1))
    extras = installed_extras(dockerfile)
    assert extras, "the CPU image never runs `pip install .`"
    defined = set(pyproject()["project"].get("optional-dependencies", {}))
    for chosen in extras:
        assert chosen <= defined
        assert "gpu" not in chosen, "the CPU image must not pull in the GPU stack"


def test_gpu_image_base_python_and_extra() -> None:
    dockerfile = parse_dockerfile(GPU_DOCKERFILE)
    assert re.fullmatch(r"nvidia/cuda:12\.[\w.-]*runtime[\w.-]*", dockerfile.final.base), (
        dockerfile.final.base
    )

    runs = " ".join(dockerfile.all("RUN"))
    pythons = re.findall(r"--python[ =](\d+\.\d+)", runs)
    assert pythons, "the GPU image does not pick a Python version for its virtualenv"
    for version in pythons:
        python_version_satisfies_project(version)

    extras = installed_extras(dockerfile)
    assert any("gpu" in chosen for chosen in extras), "the GPU image does not install .[gpu]"
    optional = pyproject()["project"].get("optional-dependencies", {})
    assert "gpu" in optional, "pyproject.toml defines no `gpu` extra"
    assert any(re.match(r"openpipe-art\[[^\]]*\bbackend\b", dep) for dep in optional["gpu"]), (
        "the gpu extra does not pull in openpipe-art[backend]"
    )


def test_gpu_image_ships_uv_for_arts_vllm_runtime() -> None:
    dockerfile = parse_dockerfile(GPU_DOCKERFILE)
    uv_stages = {s.name for s in dockerfile.stages if s.base.startswith("ghcr.io/astral-sh/uv")}
    copies_uv = False
    for rest in dockerfile.final.args("COPY"):
        source = re.search(r"--from=(\S+)", rest)
        if source and source.group(1) in uv_stages and re.search(r"(^|\s)/uv(\s|$)", rest):
            copies_uv = True
    installs_uv = bool(re.search(r"pip install [^&;]*\buv\b", " ".join(dockerfile.all("RUN"))))
    assert copies_uv or installs_uv, "uv is not installed in the GPU image"
