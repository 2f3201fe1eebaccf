"""Fixtures for the store client tests; the pdserve store processes (``cluster``,
``cluster_factory``) come from tests/conftest.py, shared with the storage node tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.store.mooncake_cluster import MooncakeCluster


@pytest.fixture(scope="module")
def mooncake_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    """A Mooncake Store cluster; skipped with the reason when mooncake does not import."""
    from pdserve.store.mooncake_backend import available

    if not available():
        pytest.skip("mooncake-transfer-engine is not installed (mooncake.store does not import)")
    c = MooncakeCluster.start(tmp_path_factory.mktemp("mooncake"), "128MiB", lease_ms=500)
    yield c
    c.stop()
