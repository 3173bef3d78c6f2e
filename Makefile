# Trainyard developer commands. `make run` and `make test` do all their own set-up.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck check openapi bench clean

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit("Trainyard needs Python >= 3.11, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,cpu]"
	@touch $(STAMP)

## Serve the API and an in-process worker on http://127.0.0.1:8000 (embedded SQLite), with
## a tiny model registered as `demo` on the cpu backend (TRAINYARD_DEMO_MODEL=false: none).
run: $(STAMP)
	$(BIN)/trainyard migrate
	TRAINYARD_DEMO_MODEL=$${TRAINYARD_DEMO_MODEL:-true} $(BIN)/trainyard serve

## Run the whole test suite (SQLite; also Postgres when TRAINYARD_TEST_DATABASE_URL is set).
test: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_ARGS)

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

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
