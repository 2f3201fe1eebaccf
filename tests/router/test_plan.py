"""Plan choice as a pure function (no workers, no servers)."""

from __future__ import annotations

import pytest

from pdserve.services.router.plan import Plan, choose_plan


def plan(mode="read", n=100, cached=0, chunk=32, prefill=2, threshold=0) -> Plan:
    return choose_plan(
        mode=mode,
        prompt_tokens=n,
        cached_tokens=cached,
        chunk_size=chunk,
        prefill_workers=prefill,
        local_threshold=threshold,
    )


def test_read_is_the_default_with_prefill_workers():
    assert plan() == Plan.READ


@pytest.mark.parametrize("mode", ["read", "write", "colocated"])
def test_no_prefill_worker_means_local(mode):
    assert plan(mode, prefill=0) == Plan.LOCAL


def test_colocated_mode_is_local():
    assert plan("colocated") == Plan.LOCAL


def test_write_needs_a_full_chunk_before_the_last_token():
    assert plan("write", n=33, chunk=32) == Plan.WRITE
    # 32 tokens: the only full chunk holds the last token, which decode must compute
    assert plan("write", n=32, chunk=32) == Plan.READ
    assert plan("write", n=100, chunk=0) == Plan.READ  # chunk size not known yet


def test_short_uncached_part_prefills_on_the_decode_worker():
    assert plan(n=100, cached=80, threshold=32) == Plan.LOCAL  # 20 uncached
    assert plan(n=100, cached=64, threshold=32) == Plan.READ  # 36 uncached
    assert plan(n=100, cached=100, threshold=0) == Plan.READ  # 0 = never local
    assert plan(n=10, cached=10, threshold=2) == Plan.LOCAL  # at least 1 token is uncached


def test_values_are_the_log_and_metric_strings():
    assert [p.value for p in Plan] == [
        "read",
        "write",
        "local",
        "read->local",
        "write->local",
        "write->read",
    ]
