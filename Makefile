# The two commands of the README. Both set up (idempotently) first.
.PHONY: up test check setup lint

setup:
	@bash scripts/setup.sh

up: setup
	.venv/bin/pdserve up

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# One pytest worker per core (at most 4); a test file runs whole on one worker, so a module's
# shared engine or cluster starts once.
test: setup lint
	.venv/bin/python -m pytest -n auto --maxprocesses 4 --dist loadfile

# Lint and the tests that start no process (a process-starting test not marked slow fails).
check: setup lint
	PDSERVE_NO_PROCESSES=1 .venv/bin/python -m pytest -m "not slow" -q
