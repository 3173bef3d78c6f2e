# Trainyard developer commands. `make run` and `make test` do all their own set-up.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# openpipe-art 0.5.23 needs Python 3.12: its own venv, .venv-art, holds it (without torch),
# the server with its dev extra and the client. It runs the README's ART program in
# tests/test_art_backend.py beside 0.5.18 in .venv, and the whole suite (`make test-312`).
PY312     ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
ART_STAMP := .venv-art/.installed
NAT_VENV  ?= .venv-nat
NAT_STAMP := $(NAT_VENV)/.installed
SKY_VENV  ?= .venv-sky
SKY_STAMP := $(SKY_VENV)/.installed
TINKER_VENV  ?= .venv-tinker
TINKER_STAMP := $(TINKER_VENV)/.installed

# uv installs every environment, pinned by the constraints files as pip would be: the same
# packages (checked against pip's, environment by environment) in about a tenth of the
# time (NAT's: 14 s against 120 s here). It comes from PyPI, pinned, into a venv of its
# own. Wheels this machine keeps on disk (pip's find-links: the CPU build of torch) are
# given to uv too; without them torch==2.13.0 would be PyPI's CUDA build. uv compiles no
# bytecode at install (pip does: all of it, most never imported; 173 s for the five
# environments with `--compile-bytecode`, against 35 s): Python writes it on first import,
# which the test targets let it do where PYTHONDONTWRITEBYTECODE is set (CI's machines), or
# every process there would compile torch and transformers again as it imports them.
UV_VENV    := .venv-uv
UV         := $(UV_VENV)/bin/uv
UV_VERSION := 0.13.10
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL  = $(UV) pip install --quiet $(foreach links,$(FIND_LINKS),--find-links $(links)) --python

.PHONY: run test test-312 lint typecheck check openapi bench bench-compare clean

$(UV):
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install --quiet uv==$(UV_VERSION)

# The server with its dev and cpu extras, and the client distribution (clients/python: SDK
# and CLI) beside it, editable, so its tests run against this checkout's server.
$(STAMP): pyproject.toml constraints.txt clients/python/pyproject.toml | $(UV)
	@$(PYTHON) -c 'import sys; sys.exit("Trainyard needs Python >= 3.11, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(UV_INSTALL) $(BIN)/python -c constraints.txt -e ".[dev,cpu]" -e "clients/python[cli,art]"
	@touch $(STAMP)

# No cpu extra: every torch for Python 3.12 here is a multi-GB CUDA build. constraints-art.txt
# is this environment's `pip freeze --exclude-editable`.
$(ART_STAMP): pyproject.toml clients/python/pyproject.toml constraints-art.txt | $(UV)
	rm -rf .venv-art
	$(PY312) -m venv .venv-art
	$(UV_INSTALL) .venv-art/bin/python -c constraints-art.txt "openpipe-art==0.5.23" \
		-e ".[dev]" -e "clients/python[cli,art]"
	@.venv-art/bin/python -c 'import importlib.util, sys; sys.exit("torch got into .venv-art") if importlib.util.find_spec("torch") else None'
	@touch $(ART_STAMP)

# NeMo Agent Toolkit 1.9 in an environment of its own (its dependencies and the server's
# are not one set), with the client's NAT plugin: `tests/test_nat_finetune.py` runs a real
# `nat finetune` from it. nvidia-nat-profiler is needed although nothing requires it:
# without it NAT records no LLM call and builds no trajectory. No torch: NAT trains nothing
# itself here, Trainyard does. The `judge` extra brings openevals, whose string evaluators
# (NAT's `langsmith` evaluator) score without an LLM judge.
$(NAT_STAMP): constraints-nat.txt clients/python/pyproject.toml | $(UV)
	@$(PYTHON) -c 'import sys; sys.exit("NAT 1.9 needs Python 3.11 to 3.13, found " + sys.version.split()[0]) if not (3, 11) <= sys.version_info[:2] <= (3, 13) else None'
	$(PYTHON) -m venv $(NAT_VENV)
	$(UV_INSTALL) $(NAT_VENV)/bin/python -c constraints-nat.txt \
		nvidia-nat-core==1.9.0 "nvidia-nat-eval[full]==1.9.0" "nvidia-nat-langchain[openai,judge]==1.9.0" \
		nvidia-nat-openpipe-art==1.9.0 nvidia-nat-profiler==1.9.0 -e "clients/python[nat]"
	@$(NAT_VENV)/bin/python -c 'import importlib.util, sys; sys.exit("torch got into $(NAT_VENV)") if importlib.util.find_spec("torch") else None'
	@touch $(NAT_STAMP)

# SkyPilot in an environment of its own (it pins click < 8.2 and uvicorn < 0.36; the server
# has newer ones): tests/test_skypilot.py loads deploy/skypilot/worker-gpu.yaml with it.
# constraints-sky.txt is this environment's `pip freeze`.
$(SKY_STAMP): constraints-sky.txt | $(UV)
	$(PYTHON) -m venv $(SKY_VENV)
	$(UV_INSTALL) $(SKY_VENV)/bin/python -c constraints-sky.txt skypilot==0.14.1
	@touch $(SKY_STAMP)

# The Tinker SDK (tinker 0.38.0) in an environment of its own: it is a client, and the server
# depends neither on it nor on protobuf (app/tinker/wire.py reads and writes its messages).
# tests/test_tinker_sdk.py runs programs written against it from here.
# constraints-tinker.txt is this environment's `pip freeze`.
$(TINKER_STAMP): constraints-tinker.txt | $(UV)
	$(PYTHON) -m venv $(TINKER_VENV)
	$(UV_INSTALL) $(TINKER_VENV)/bin/python -c constraints-tinker.txt tinker==0.38.0
	@touch $(TINKER_STAMP)

## Serve the API and an in-process worker on http://127.0.0.1:8000 (embedded SQLite), with
## a tiny model registered as `demo` on the cpu backend (TRAINYARD_DEMO_MODEL=false: none).
run: $(STAMP)
	$(BIN)/trainyard migrate
	TRAINYARD_DEMO_MODEL=$${TRAINYARD_DEMO_MODEL:-true} $(BIN)/trainyard serve

## Run the whole test suite (SQLite; also Postgres when TRAINYARD_TEST_DATABASE_URL is set),
## with the environments the ART 0.5.23 and `nat finetune` tests run.
test: $(STAMP) $(ART_STAMP) $(NAT_STAMP) $(SKY_STAMP) $(TINKER_STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest -q $(PYTEST_ARGS)

## The suite again on Python 3.12 with openpipe-art 0.5.23 (.venv-art), on SQLite only. It
## has no torch: the tests marked `torch` are skipped, and the summary names each of them.
## Left to the 3.11 run: modules that test the HTTP edge and webhook delivery, which touch
## no ART object (schema fuzzing, hostile and large bodies, webhooks), and the clients' CLI
## and README programs; they took about 5 of the leg's 10 minutes here. Also left to it:
## worker pools across processes, object storage, datasets, serving admission and the
## deploy manifests, none of which reads an ART object either; and the trainer outage
## under load (41 s of worker processes; the dry-run backend that every other job here
## trains on speaks the same 0.5.23 Protocol).
PY312_DESELECT := tests/test_schema_fuzz.py tests/test_large_bodies.py tests/test_hostile_bodies.py \
	tests/test_webhooks.py tests/test_edge.py tests/test_client_cli.py tests/test_client_readme.py \
	tests/test_pool_processes.py tests/test_checkpoint_storage.py tests/test_datasets.py \
	tests/test_serving.py tests/test_k8s.py tests/test_skypilot.py tests/test_attacks.py \
	tests/test_faults.py::test_trainer_outage_under_load_retries_every_job_and_trains_each_once
test-312: $(ART_STAMP) $(NAT_STAMP) $(SKY_STAMP)
	env -u TRAINYARD_TEST_DATABASE_URL -u PYTHONDONTWRITEBYTECODE .venv-art/bin/pytest -q \
		$(addprefix --deselect ,$(PY312_DESELECT)) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck test

## Regenerate openapi.json after changing routes or schemas.
openapi: $(STAMP)
	$(BIN)/trainyard openapi > openapi.json

bench: $(STAMP)
	$(BIN)/python -m bench

## Queue throughput and dispatch latency of the working tree against REV (default HEAD), in
## interleaved pairs: `make bench-compare REV=HEAD~1 BENCH_COMPARE_ARGS="--pairs 5"`.
REV ?= HEAD
bench-compare: $(STAMP)
	$(BIN)/python -m bench.compare --against $(REV) $(BENCH_COMPARE_ARGS)

clean:
	rm -rf $(VENV) .venv-art $(NAT_VENV) $(SKY_VENV) $(TINKER_VENV) $(UV_VENV) var .pytest_cache .mypy_cache .ruff_cache
