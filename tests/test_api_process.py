"""An API-only process (`TRAINYARD_WORKER_ENABLED=false`) never loads the training stack.

ART imports litellm, polars and, where installed, torch and transformers: seconds of start
and hundreds of MB that an API replica has no use for. The process here is built and
served as `trainyard serve` builds it, in a fresh interpreter, and driven through the
routes an API replica answers; then its `sys.modules` is read. This checks what is
imported, not how fast: `bench/api_start.py` measures the start and the memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import art_groups, model_body, nat_collection

pytestmark = pytest.mark.slow

TRAINING_STACK = ("art", "torch", "transformers", "peft", "litellm", "polars", "weave", "asyncpg")

# Served on a free port in this interpreter, as `trainyard serve` serves it; then each
# request of argv[1] is made and must succeed, and the training stack's modules in
# sys.modules are printed.
DRIVER = """
import asyncio, json, sys
import httpx, uvicorn
from app.main import create_app
from app.server import config
from app.settings import get_settings

async def main(requests, stack):
    settings = get_settings()
    assert not settings.worker_enabled
    server = uvicorn.Server(config(create_app(settings), settings, port=0))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        for method, path, body in requests:
            if isinstance(body, str):  # a dataset's lines
                headers = {"content-type": "application/jsonl"}
                response = await client.request(method, path, content=body, headers=headers)
            else:
                response = await client.request(method, path, json=body)
            assert response.status_code < 300, (method, path, response.status_code, response.text)
    server.should_exit = True
    await serving
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in stack)))

asyncio.run(main(json.loads(sys.argv[1]), json.loads(sys.argv[2])))
"""


def test_an_api_process_serves_without_importing_the_training_stack(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    model = "/v1/models/agent"
    example = {"id": "q1", "messages": [{"role": "user", "content": "2+2?"}], "expected": "4"}
    requests = [
        ("GET", "/healthz", None),
        ("GET", "/readyz", None),
        ("GET", "/metrics", None),
        ("GET", "/v1/backends", None),
        ("POST", "/v1/models", model_body("agent")),
        ("POST", "/v1/models", {"name": "gpu", "base_model": "b", "backend": "art-local"}),
        ("GET", "/v1/models", None),
        ("GET", model, None),
        ("POST", "/v1/training-jobs", {"model": "agent", "collection": nat_collection()}),
        ("POST", "/v1/training-jobs", {"model": "agent", "groups": art_groups()}),
        ("GET", "/v1/training-jobs?model=agent", None),
        ("GET", f"{model}/checkpoints", None),
        ("GET", f"{model}/aliases", None),
        ("PUT", f"{model}/retention", {"keep_last": 1}),
        ("POST", f"{model}/retention/apply", None),
        ("POST", "/v1/datasets?name=toy", json.dumps(example) + "\n"),
        ("GET", "/v1/datasets", None),
        ("GET", "/v1/runs", None),
        ("GET", "/openai/v1/models", None),
        ("GET", "/openapi.json", None),
    ]
    env = {
        **os.environ,
        "TRAINYARD_WORKER_ENABLED": "false",
        "TRAINYARD_DATA_DIR": str(data),
        "TRAINYARD_DATABASE_URL": f"sqlite+aiosqlite:///{data / 'trainyard.db'}",
        "TRAINYARD_MIGRATE_ON_START": "true",
        "TRAINYARD_DEMO_MODEL": "false",
        "TRAINYARD_API_KEYS": "",
    }
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(requests), json.dumps(TRAINING_STACK)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == [], f"an API-only process imported {imported}"
