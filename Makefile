# The two commands of the README. Both set up (idempotently) first.
.PHONY: up test check setup lint

setup:
	@bash scripts/setup.sh

up: setup
	.venv/bin/pdserve up

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# One pytest worker per core (pytest-xdist), a file whole on one worker, the files with vLLM
# tests first. PYTEST_ARGS= (empty) runs the suite serially in one process.
PYTEST_ARGS ?= -n auto --dist loadfile

test: setup lint
	.venv/bin/python -m pytest $(PYTEST_ARGS)

# Lint and the tests that start no process (a process-starting test not marked slow fails).
check: setup lint
	PDSERVE_NO_PROCESSES=1 .venv/bin/python -m pytest -m "not slow" -q
