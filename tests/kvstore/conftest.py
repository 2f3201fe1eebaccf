"""Fixtures for the KV store master tests."""

from __future__ import annotations

import pytest

from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.state import MasterState
from pdserve.services.kvstore.master.types import Clock


class FakeClock(Clock):
    def __init__(self) -> None:
        self.t = 1000.0

    def mono(self) -> float:
        return self.t

    def wall_ms(self) -> float:
        return 1.7e12 + self.t * 1000.0

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[int, str, int, int]] = []

    def __call__(self, type_: int, key: str, size: int, reason: int, *tier: int) -> None:
        self.events.append((type_, key, size, reason, *tier))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def events() -> Recorder:
    return Recorder()


@pytest.fixture
def make_state(clock: FakeClock, events: Recorder):
    def make(store=None, **overrides) -> MasterState:
        cfg = MasterConfig(**overrides)
        cfg.validate()
        return MasterState(cfg, clock=clock, store=store, on_event=events, placement_seed=1)

    return make
