# The two commands of the README. Both set up (idempotently) first.
.PHONY: up test setup lint

setup:
	@bash scripts/setup.sh

up: setup
	.venv/bin/pdserve up

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

test: setup lint
	.venv/bin/python -m pytest
