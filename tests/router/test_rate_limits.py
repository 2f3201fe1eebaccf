"""Per-tenant rate limits (services/router/rate_limit.py) and the tenants file's flow-control
options (pdserve/tenants.py), on a fake clock, without a network."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.config import ConfigError
from pdserve.errors import RateLimited
from pdserve.services.router.admission import Admission
from pdserve.services.router.rate_limit import RateLimits, TokenBucket
from pdserve.telemetry import REGISTRY
from pdserve.tenants import TenantLimits, Tenants

KA, KB = "a" * 16 + "-alpha-key", "b" * 16 + "-beta-key"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tenants(tmp_path: Path, text: str) -> Tenants:
    path = tmp_path / "tenants"
    path.write_text(text)
    return Tenants.load(str(path))


def test_options_of_the_tenants_file(tmp_path: Path) -> None:
    t = _tenants(tmp_path, f"alpha {KA} share=2 rps=5 tps=2000\nbeta {KB}  tps=0.5\n")
    assert t.tenant_of(KA) == "alpha"
    assert t.limits_of("alpha") == TenantLimits(share=2.0, rps=5.0, tps=2000.0)
    assert t.limits_of("beta") == TenantLimits(tps=0.5)
    assert t.limits_of("") == TenantLimits() == t.limits_of("nobody")
    assert t.names == ["", "alpha", "beta"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("share=0", "share must be a number > 0, got '0'"),
        ("rps=-1", "rps must be a number > 0, got '-1'"),
        ("tps=fast", "tps must be a number > 0, got 'fast'"),
        ("rps=nan", "rps must be a number > 0"),
        ("rps=inf", "rps must be a number > 0"),
        ("rps=1 rps=2", "rps is given twice"),
        ("shares=2", "field 3 is not an option; expected 'NAME KEY [share=N] [rps=N] [tps=N]' "
         "(did you mean 'share'?)"),
    ],
)  # fmt: skip
def test_bad_options_name_the_line_and_the_option(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _tenants(tmp_path, f"# keys\nalpha {KA} {line}\n")
    assert "line 2: " + message in str(err.value) and KA not in str(err.value)


def test_a_bucket_holds_one_seconds_worth_and_refills_at_its_rate() -> None:
    b = TokenBucket.per_second(4.0, now=0.0)
    for _ in range(4):
        assert b.wait_s(1, 0.0) == 0.0
        b.take(1, 0.0)
    assert b.wait_s(1, 0.0) == pytest.approx(0.25)
    assert b.wait_s(1, 0.25) == 0.0
    b.take(1, 0.25)
    assert b.wait_s(1, 10.0) == 0.0 and b.level == 4.0  # capped at capacity


def test_a_slow_bucket_still_passes_one_unit() -> None:
    b = TokenBucket.per_second(0.5, now=0.0)
    assert b.capacity == 1.0 and b.wait_s(1, 0.0) == 0.0
    b.take(1, 0.0)
    assert b.wait_s(1, 0.0) == pytest.approx(2.0)


def test_a_cost_above_capacity_waits_for_a_full_bucket_then_goes_into_debt() -> None:
    b = TokenBucket.per_second(100.0, now=0.0)
    assert b.wait_s(250, 0.0) == 0.0  # a full bucket lets a long prompt through
    b.take(250, 0.0)
    assert b.level == -150.0
    assert b.wait_s(10, 0.0) == pytest.approx(1.6)  # the debt and the next cost
    assert b.wait_s(250, 0.0) == pytest.approx(2.5)  # back to full


def test_rate_limits_refuse_with_the_limit_and_when_to_retry(tmp_path: Path) -> None:
    clock = Clock()
    t = _tenants(tmp_path, f"alpha {KA} rps=2 tps=100\nbeta {KB}\n")
    rates = RateLimits(t, clock)
    rates.check("alpha", 50)
    rates.check("alpha", 50)
    with pytest.raises(RateLimited) as err:
        rates.check("alpha", 10)
    assert err.value.limit == "requests" and err.value.retry_after_s == pytest.approx(0.5)
    assert err.value.retry_after == "1"
    assert "tenant 'alpha' is over its rate limit of 2 requests per second; retry in 0.50 s" in str(
        err.value
    )
    clock.now += 0.5
    with pytest.raises(RateLimited) as err:  # one request is back, 50 tokens, not 80
        rates.check("alpha", 80)
    assert err.value.limit == "tokens" and err.value.retry_after_s == pytest.approx(0.3)
    assert "100 prompt tokens per second" in str(err.value)
    rates.check("alpha", 5)  # the refusals took nothing
    for _ in range(100):  # no limits: never refused
        rates.check("beta", 10_000)
        rates.check("", 10_000)


def test_admission_counts_rate_limited_requests_per_tenant(tmp_path: Path) -> None:
    clock = Clock()
    t = _tenants(tmp_path, f"alpha {KA} rps=1\n")
    adm = Admission(8, 8, tenants=t, rates=RateLimits(t, clock))

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = sample("pdserve_router_tenant_rate_limited_total", tenant="alpha", limit="requests")
    total = sample("pdserve_router_rejected_total", reason="rate_limit")
    adm.check(10, 1, "alpha", 10)
    with pytest.raises(RateLimited, match=r"retry in 1\.00 s"):
        adm.check(10, 1, "alpha", 10)
    assert (
        sample("pdserve_router_tenant_rate_limited_total", tenant="alpha", limit="requests")
        == before + 1
    )
    assert sample("pdserve_router_rejected_total", reason="rate_limit") == total + 1
    # every tenant's series exist from the start (bounded: the file's tenants and anonymous)
    assert (
        REGISTRY.get_sample_value(
            "pdserve_router_tenant_rejected_total", {"tenant": "", "reason": "queue_full"}
        )
        is not None
    )
