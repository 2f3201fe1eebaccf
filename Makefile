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

# The docker-compose lab (docs/deploy.md). Root, Docker (deploy/lab/dockerd.sh installs and
# starts it) and minutes; not part of `make test`. IMAGE_ARGS= (empty) builds from the index.
.PHONY: image lab lab-down lab-test
IMAGE_ARGS ?= --offline

image:
	DOCKER=$$(bash deploy/lab/dockerd.sh) bash deploy/build-image.sh $(IMAGE_ARGS)

lab:
	bash deploy/lab/lab.sh up

lab-down:
	bash deploy/lab/lab.sh down

# Starts the lab if it is not up, runs tests/lab against it; its last test tears it down.
lab-test: lab
	PDSERVE_LAB=1 .venv/bin/python -m pytest tests/lab -v -p no:cacheprovider
