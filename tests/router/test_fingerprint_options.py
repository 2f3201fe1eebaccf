"""The router keys prompts with the KV options its workers registered (as with the TP size):
workers started with ``hf_overrides`` or ``quantization`` are served, not refused."""

from __future__ import annotations

from pdserve.hashing import ModelFingerprint
from pdserve.services.router.fingerprint import FingerprintSource

OPTIONS = 'quantization="fp8"'


def test_the_workers_options_join_the_routers_fingerprint() -> None:
    worker = ModelFingerprint("smollm2", "rev1", "float32", 32, options=OPTIONS)
    plain = ModelFingerprint("smollm2", "rev1", "float32", 32)
    workers = [worker.to_labels(), worker.to_labels(), plain.to_labels()]
    src = FingerprintSource(
        "smollm2", "rev1", kv_dtype="auto", chunk_size=0, workers=lambda: workers
    )
    assert src.current() == worker
    reasons = src.refusals(workers)
    assert reasons[:2] == ["", ""]
    assert reasons[2].startswith("KV fingerprint differs from the cluster's")
