from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import replace

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.hashing import (
    DIGEST_LABEL,
    ModelFingerprint,
    chain_hashes,
    chain_root,
    chunk_keys,
    tail_key,
)

FP = ModelFingerprint("test-model", chunk_size=4)

# Fixed vectors: a change here breaks every stored cache, so it must be deliberate.
ROOT_HEX = "d79f841d6d0bf18c0a8dccecc02a0ec322c40752f701643b710a2c9a8ca960dd"
KEYS_0_TO_9 = [
    "ab109d205eda353ad3ec2bc7d56cd4ca585a4da4a147448d3a200f931421cf13",
    "eb5a44c432a0cfed60a3bd291aab58e88ff2c22708c711bc46943c5e766c954e",
]
TAIL_0_TO_9 = "tail-0f2432ebe87cc0b7e0dff22c425ed7ce92108c83d8955f530a8ecc83eef6beed"


SALTED_ROOT_HEX = "3690ced1ce03e9f84117f569d645b0b19d02b3cadc4df941cab02250bd0ecb33"
SALTED_KEYS_0_TO_9 = [
    "6417ae7c99298bcff26f1e5113f24b13e0681f86fdb9af1af8481d4aac429a4c",
    "450fa2937fcf546a4b485017cc595b8be19494da8db3b7fb0788f07f31358d81",
]
SALTED_TAIL_0_TO_9 = "tail-02ace22df0344ee25e1d9768de04d24fe62ff7796a7ae16b49af34c786d57c6d"


def test_fixed_vectors():
    assert FP.digest().hex() == ROOT_HEX
    assert chunk_keys(FP, list(range(10))) == KEYS_0_TO_9
    assert tail_key(FP, list(range(10)), "req-1") == TAIL_0_TO_9


def test_chain_matches_the_documented_formula():
    root = FP.digest()
    h1 = blake3.blake3(root + struct.pack("<4I", 0, 1, 2, 3)).digest()
    h2 = blake3.blake3(h1 + struct.pack("<4I", 4, 5, 6, 7)).digest()
    assert chain_hashes(root, list(range(10)), 4) == [h1, h2]


def test_cache_salt_changes_only_the_documented_root():
    salted = blake3.blake3(FP.canonical() + struct.pack("<I", 8) + b"tenant-a").digest()
    assert chain_root(FP, "tenant-a") == salted
    assert salted.hex() == SALTED_ROOT_HEX
    assert chunk_keys(FP, list(range(10)), "tenant-a") == SALTED_KEYS_0_TO_9
    assert chain_hashes(salted, list(range(10)), 4) == [
        bytes.fromhex(k) for k in SALTED_KEYS_0_TO_9
    ]
    assert tail_key(FP, list(range(10)), "req-1", "tenant-a") == SALTED_TAIL_0_TO_9
    # no salt ("") keeps the unsalted keys, so chunks stored before salts existed stay valid
    assert chain_root(FP, "") == FP.digest()
    assert chunk_keys(FP, list(range(10)), "") == KEYS_0_TO_9
    assert tail_key(FP, list(range(10)), "req-1", "") == TAIL_0_TO_9
    # UTF-8 bytes, length-prefixed: non-ASCII salts and salts that extend another differ
    assert chain_root(FP, "é") == blake3.blake3(FP.canonical() + b"\x02\0\0\0\xc3\xa9").digest()


@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_salted_chains_share_no_key_with_each_other_or_the_unsalted_one(a, b):
    tokens = list(range(12))
    keys_a = chunk_keys(FP, tokens, a)
    assert not set(keys_a) & set(chunk_keys(FP, tokens))
    if a != b:
        assert not set(keys_a) & set(chunk_keys(FP, tokens, b))
        assert tail_key(FP, tokens[:9], "r", a) != tail_key(FP, tokens[:9], "r", b)
    assert tail_key(FP, tokens[:9], "r", a) != tail_key(FP, tokens[:9], "r")


@pytest.mark.slow
def test_keys_identical_across_processes_and_hash_seeds():
    code = (
        "from pdserve.hashing import ModelFingerprint, chunk_keys;"
        "print(chunk_keys(ModelFingerprint('test-model', chunk_size=4), list(range(10)))[1])"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("0", "1", "12345")
    }
    assert outs == {KEYS_0_TO_9[1]}


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"revision": "r2"},
        {"kv_dtype": "bfloat16"},
        {"chunk_size": 8},
        {"layout_version": 2},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"kv_compression": "bf16"},
        {"kv_compression": "fp8"},
    ],
)
def test_fingerprint_covers_every_field(change):
    assert replace(FP, **change).digest() != FP.digest()


def test_only_full_chunks_get_keys_and_prefixes_share_keys():
    assert chunk_keys(FP, [1, 2, 3]) == []
    a = chunk_keys(FP, list(range(12)))
    b = chunk_keys(FP, [*range(8), 99, 98, 97, 96])
    assert a[:2] == b[:2] and a[2] != b[2]


def test_tail_key_is_request_scoped_and_empty_on_boundary():
    assert tail_key(FP, list(range(8)), "r") == ""
    assert tail_key(FP, list(range(9)), "a") != tail_key(FP, list(range(9)), "b")
    assert tail_key(FP, list(range(9)), "a") != tail_key(FP, [*range(8), 7], "a")


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40))
def test_chain_is_prefix_stable(tokens):
    keys = chunk_keys(FP, tokens)
    assert len(keys) == len(tokens) // 4
    for n in range(0, len(tokens) + 1, 4):
        assert chunk_keys(FP, tokens[:n]) == keys[: n // 4]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_id": ""},
        {"kv_dtype": "int3"},
        {"chunk_size": 0},
        {"tp_rank": 2, "tp_size": 2},
        {"kv_compression": "zstd"},
        {"kv_compression": "bf16", "kv_dtype": "bfloat16"},  # a no-op: resolve it to none
    ],
)
def test_invalid_fingerprints_are_rejected(kwargs):
    with pytest.raises(ValueError):
        ModelFingerprint(**{"model_id": "m", **kwargs})


@pytest.mark.parametrize(
    "fp",
    [
        FP,
        ModelFingerprint("m/x y", "rev", "bfloat16", 256, kv_compression="fp8", tp_size=4),
        ModelFingerprint("m", kv_dtype="float16", chunk_size=32, tp_rank=1, tp_size=2),
        replace(FP, layout_version=2),
    ],
)
def test_fingerprint_labels_round_trip(fp):
    """One string form (registration labels, the vLLM connector's config), read back whole;
    the digest rides along as hex."""
    labels = fp.to_labels()
    assert all(isinstance(v, str) for v in labels.values())
    assert labels[DIGEST_LABEL] == fp.digest().hex()
    assert ModelFingerprint.from_labels(labels) == fp
    assert ModelFingerprint.from_labels(json.loads(json.dumps(labels))) == fp


def test_fingerprint_labels_defaults_and_errors():
    # only the settings: the model id from the caller, the rest the field defaults
    fp = ModelFingerprint.from_labels({"kv_dtype": "float32", "chunk_size": "4"}, model_id="m")
    assert fp == ModelFingerprint("m", chunk_size=4)
    good = FP.to_labels()
    for bad in (
        {"kv_dtype": ""},
        {"chunk_size": "four"},
        {"chunk_size": "0"},
        {"tp": "2"},
        {"tp": "2/2"},
        {"kv_compression": "zstd"},
        {"model_id": ""},
    ):
        with pytest.raises(ValueError):
            ModelFingerprint.from_labels({**good, **bad})
    with pytest.raises(ValueError, match="chunk_size"):
        ModelFingerprint.from_labels({"kv_dtype": "float32"}, model_id="m")


def test_out_of_range_token_ids_are_rejected():
    with pytest.raises(ValueError, match="uint32"):
        chunk_keys(FP, [0, 1, 2, -1])


def test_compression_goes_into_the_dtype_field_and_none_keeps_every_key():
    """Chunks of another encoding hold other numerics, so they get other keys (a worker never
    reads them as a hit); uncompressed keys stay those of the fixed vectors."""
    assert replace(FP, kv_compression="none").digest().hex() == ROOT_HEX
    fp8 = replace(FP, kv_compression="fp8")
    assert fp8.canonical() == FP.canonical().replace(
        struct.pack("<I", 7) + b"float32", struct.pack("<I", 11) + b"float32+fp8"
    )
    keys = {c: chunk_keys(replace(FP, kv_compression=c), list(range(12))) for c in ("bf16", "fp8")}
    keys["none"] = chunk_keys(FP, list(range(12)))
    for a in keys:
        for b in keys:
            assert a == b or not set(keys[a]) & set(keys[b])
    assert tail_key(fp8, list(range(9)), "r") != tail_key(FP, list(range(9)), "r")


@given(st.text(min_size=1, max_size=12))
def test_no_salt_turns_one_encoding_into_another(salt):
    """Salts extend the canonical encoding; compression changes a field inside it, so no
    salted chain of one encoding is the chain of another (a salt "fp8" included)."""
    tokens = list(range(8))
    fp8 = replace(FP, kv_compression="fp8")
    assert not set(chunk_keys(FP, tokens, salt)) & set(chunk_keys(fp8, tokens))
    assert not set(chunk_keys(fp8, tokens, salt)) & set(chunk_keys(FP, tokens))
