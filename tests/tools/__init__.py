"""Tools the tests use and a developer runs by hand: the fuzzers (:mod:`.fuzz`). Imported
as ``tools`` by the tests (tests/ is on their path) and run as ``python -m tests.tools.fuzz``
from the repository root."""
