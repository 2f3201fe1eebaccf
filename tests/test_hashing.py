from __future__ import annotations

import os
import struct
import subprocess
import sys
from dataclasses import replace

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.hashing import ModelFingerprint, chain_hashes, chunk_keys, tail_key

FP = ModelFingerprint("test-model", chunk_size=4)

# Fixed vectors: a change here breaks every stored cache, so it must be deliberate.
ROOT_HEX = "d79f841d6d0bf18c0a8dccecc02a0ec322c40752f701643b710a2c9a8ca960dd"
KEYS_0_TO_9 = [
    "ab109d205eda353ad3ec2bc7d56cd4ca585a4da4a147448d3a200f931421cf13",
    "eb5a44c432a0cfed60a3bd291aab58e88ff2c22708c711bc46943c5e766c954e",
]
TAIL_0_TO_9 = "tail-0f2432ebe87cc0b7e0dff22c425ed7ce92108c83d8955f530a8ecc83eef6beed"


def test_fixed_vectors():
    assert FP.digest().hex() == ROOT_HEX
    assert chunk_keys(FP, list(range(10))) == KEYS_0_TO_9
    assert tail_key(FP, list(range(10)), "req-1") == TAIL_0_TO_9


def test_chain_matches_the_documented_formula():
    root = FP.digest()
    h1 = blake3.blake3(root + struct.pack("<4I", 0, 1, 2, 3)).digest()
    h2 = blake3.blake3(h1 + struct.pack("<4I", 4, 5, 6, 7)).digest()
    assert chain_hashes(root, list(range(10)), 4) == [h1, h2]


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
    [{"model_id": ""}, {"kv_dtype": "int3"}, {"chunk_size": 0}, {"tp_rank": 2, "tp_size": 2}],
)
def test_invalid_fingerprints_are_rejected(kwargs):
    with pytest.raises(ValueError):
        ModelFingerprint(**{"model_id": "m", **kwargs})


def test_out_of_range_token_ids_are_rejected():
    with pytest.raises(ValueError, match="uint32"):
        chunk_keys(FP, [0, 1, 2, -1])
