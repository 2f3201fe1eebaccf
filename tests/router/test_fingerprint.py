"""The router's fingerprint agreed with the workers' registrations, and the refusal of workers
whose registered fingerprint is not the cluster's."""

from __future__ import annotations

import logging
from dataclasses import replace

from pdserve.hashing import ModelFingerprint
from pdserve.services.router.fingerprint import FingerprintSource


def registered(fp: ModelFingerprint, **override: str) -> dict[str, str]:
    """The fingerprint labels a worker serving ``fp`` registers (services/worker/)."""
    return {**fp.to_labels(), **override}


def source(workers: list[dict[str, str]], **settings) -> FingerprintSource:
    settings = {"kv_dtype": "auto", "chunk_size": 0, **settings}
    return FingerprintSource("smollm2", "rev1", workers=lambda: workers, **settings)


def test_unknown_until_a_worker_registers_then_the_workers_settings():
    workers: list[dict[str, str]] = []
    src = source(workers)
    assert src.current() is None
    workers.append({"kv_dtype": "bfloat16", "chunk_size": "32"})
    fp = src.current()
    assert fp == ModelFingerprint("smollm2", "rev1", "bfloat16", 32)
    assert src.current() is fp  # cached


def test_explicit_settings_win_and_a_mismatch_is_logged(caplog):
    src = source([{"kv_dtype": "bfloat16", "chunk_size": "64"}], kv_dtype="float32", chunk_size=32)
    fp = src.current()
    assert (fp.kv_dtype, fp.chunk_size) == ("float32", 32)
    assert "fit no worker's registered KV settings" in caplog.text


def test_the_workers_chunk_encoding_is_part_of_the_fingerprint():
    workers = [{"kv_dtype": "float32", "chunk_size": "32"}]
    src = source(workers)
    assert src.current().kv_compression == "none"  # workers that register none store none
    workers[0]["kv_compression"] = "fp8"
    fp = src.current()
    assert fp == ModelFingerprint("smollm2", "rev1", "float32", 32, kv_compression="fp8")
    # an explicit router setting wins; bf16 of bfloat16 KV is stored (and keyed) as none
    workers[0].update(kv_dtype="bfloat16", kv_compression="none")
    assert source(workers, kv_compression="bf16").current().kv_compression == "none"


def test_fixed_source_ignores_workers():
    fp = ModelFingerprint("m", "r", "float32", 16)
    assert FingerprintSource.fixed(fp).current() == fp


def test_disagreeing_workers_the_most_registered_settings_win_logged_once(caplog):
    caplog.set_level(logging.WARNING)
    a = ModelFingerprint("smollm2", "rev1", "float32", 256)
    b = ModelFingerprint("smollm2", "rev1", "float32", 32)
    workers = [registered(a), registered(a), registered(b)]
    src = source(workers)
    assert src.current() == a  # two workers at 256 beat one at 32 (not the smallest value)
    src.current()
    assert caplog.text.count("workers disagree") == 1
    workers.append(registered(b))  # a tie: the smallest settings
    assert src.current() == b
    # an explicit router setting picks among the workers' settings
    assert source(workers[:3], chunk_size=32).current() == b


def test_workers_with_another_fingerprint_are_refused_with_the_fields_that_differ():
    ours = ModelFingerprint("smollm2", "rev1", "float32", 32)
    workers = [
        registered(ours),
        registered(ours),
        registered(ModelFingerprint("smollm2", "rev1", "float32", 64)),
        registered(ModelFingerprint("smollm2", "rev2", "float32", 32)),  # other weights
        registered(ModelFingerprint("smollm2", "rev1", "float32", 32, tp_size=2)),
        {},  # a static worker registers nothing: never refused
    ]
    src = source(workers)
    assert src.current() == ours
    reasons = src.refusals(workers)
    assert reasons[:2] == ["", ""] and reasons[5] == ""
    assert "chunk_size 64 != 32" in reasons[2]
    assert "model_revision rev2 != rev1" in reasons[3] and "chunk_size" not in reasons[3]
    assert "tp 0/2 != 0/1" in reasons[4]
    assert all(r.startswith("KV fingerprint differs") for r in reasons[2:5])


def test_router_settings_no_worker_has_refuse_every_worker(caplog):
    workers = [registered(ModelFingerprint("smollm2", "rev1", "bfloat16", 32))]
    src = source(workers, kv_dtype="float32")
    assert src.current().kv_dtype == "float32"
    assert "kv_dtype bfloat16 != float32" in src.refusals(workers)[0]
    assert "every worker is refused" in caplog.text


def test_tensor_parallel_workers_are_keyed_by_their_rank_0_fingerprint() -> None:
    """A TP worker registers the fingerprint of rank 0 with tp "0/N": the router keys prompts
    with it (so its lookups find the chunks rank 0 stores), and does not refuse the worker."""
    tp2 = ModelFingerprint(
        model_id="m", revision="r", kv_dtype="bfloat16", chunk_size=32, tp_size=2
    )
    labels = {
        "fingerprint": tp2.digest().hex(),
        "kv_dtype": "bfloat16",
        "chunk_size": "32",
        "tp": "0/2",
    }
    src = FingerprintSource("m", "r", kv_dtype="auto", chunk_size=0, workers=lambda: [labels])
    assert src.current() == tp2
    assert src.refusals([labels]) == [""]
    single = {**labels, "tp": "0/1", "fingerprint": replace(tp2, tp_size=1).digest().hex()}
    both = FingerprintSource(
        "m", "r", kv_dtype="auto", chunk_size=0, workers=lambda: [labels, labels, single]
    )
    assert both.current() == tp2 and both.refusals([single])[0].startswith("KV fingerprint")
