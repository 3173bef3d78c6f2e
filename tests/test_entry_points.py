"""Every entry point keeps litellm offline.

ART imports litellm (0.5.18 on `import art`, 0.5.23 when first used), which fetches a
model-cost map from the internet at import time unless LITELLM_LOCAL_MODEL_COST_MAP is set.
Each entry point (the `trainyard` CLI, the benchmarks, the tests, the GPU smoke script) sets
it before anything can import ART; here each is imported in a fresh interpreter without the
variable, and the variable is read at the moment litellm's import begins (which then stops,
so nothing goes online).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

WATCH = """
import os, sys

class LitellmImported(BaseException):
    pass

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "litellm":
            raise LitellmImported(os.environ.get("LITELLM_LOCAL_MODEL_COST_MAP"))
        return None

sys.meta_path.insert(0, Watch())
try:
    ENTRY
    import art  # whatever the entry point runs later: ART 0.5.18 imports litellm with it,
    import litellm  # 0.5.23 when a part of ART that uses it is first used
except LitellmImported as imported:
    print("LITELLM_LOCAL_MODEL_COST_MAP when litellm was imported:", imported.args[0])
"""

ENTRIES = {
    "trainyard CLI": "import app.cli",
    "python -m bench": "import bench.__main__",
    "tests": "import tests.backends",
    "scripts/gpu_smoke.py": "import runpy; runpy.run_path('scripts/gpu_smoke.py', run_name='x')",
    "scripts/art_local_smoke.py": (
        "import runpy; runpy.run_path('scripts/art_local_smoke.py', run_name='x')"
    ),
}


@pytest.mark.parametrize("entry", list(ENTRIES.values()), ids=list(ENTRIES))
def test_an_entry_point_keeps_litellm_offline(entry: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LITELLM_LOCAL_MODEL_COST_MAP"}
    done = subprocess.run(
        [sys.executable, "-c", WATCH.replace("ENTRY", entry)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "LITELLM_LOCAL_MODEL_COST_MAP when litellm was imported: True"
