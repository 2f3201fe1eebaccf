"""The router's fingerprint agreed with the workers' registrations, and the context limit
lowered to what the workers take."""

from __future__ import annotations

from pdserve.hashing import ModelFingerprint
from pdserve.services.router.fingerprint import FingerprintSource


def source(labels: dict[str, set[str]], kv_dtype="auto", chunk_size=0) -> FingerprintSource:
    return FingerprintSource(
        "smollm2",
        "rev1",
        kv_dtype=kv_dtype,
        chunk_size=chunk_size,
        labels=lambda n: labels.get(n, set()),
    )


def test_unknown_until_a_worker_registers_then_the_workers_settings():
    labels: dict[str, set[str]] = {}
    src = source(labels)
    assert src.current() is None
    labels.update(kv_dtype={"bfloat16"}, chunk_size={"32"})
    fp = src.current()
    assert fp == ModelFingerprint("smollm2", "rev1", "bfloat16", 32)
    assert src.current() is fp  # cached


def test_explicit_settings_win_and_a_mismatch_is_logged(caplog):
    src = source(
        {"kv_dtype": {"bfloat16"}, "chunk_size": {"64"}}, kv_dtype="float32", chunk_size=32
    )
    fp = src.current()
    assert (fp.kv_dtype, fp.chunk_size) == ("float32", 32)
    assert "lookups will miss" in caplog.text


def test_fixed_source_ignores_workers():
    fp = ModelFingerprint("m", "r", "float32", 16)
    assert FingerprintSource.fixed(fp).current() == fp
