# The two commands of the README. Both set up (idempotently) first.
.PHONY: up test check setup lint

setup:
	@bash scripts/setup.sh

up: setup
	.venv/bin/pdserve up

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# PYTEST_ARGS="-n auto --dist loadfile" runs one pytest worker per core (pytest-xdist; a
# file whole on one worker): about 18 minutes instead of 30 on 2 cores; not the default yet
# (README, "Tests").
test: setup lint
	.venv/bin/python -m pytest $(PYTEST_ARGS)

# Lint and the tests that start no process (a process-starting test not marked slow fails).
check: setup lint
	PDSERVE_NO_PROCESSES=1 .venv/bin/python -m pytest -m "not slow" -q
