"""The vLLM connector's batched scatter writes exactly what the per-block path writes, from
chunks read into the arena (a strided view, no copy) and from scattered tensors (stacked)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from pdserve import kvformat
from pdserve.engines.vllm_connector import ChunkLoad, PdserveConnector

L, H, D, BS, CHUNK = 3, 2, 8, 4, 8


def _connector(caches: list[torch.Tensor]) -> PdserveConnector:
    # Only the worker-side state the scatter reads; no vLLM engine behind it.
    conn = object.__new__(PdserveConnector)
    conn.block_size = BS
    conn._caches = caches
    conn._arena = bytearray()
    conn._arena_tensor = torch.empty(0, dtype=torch.uint8)
    return conn


def _caches() -> list[torch.Tensor]:
    return [torch.zeros(16, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]


@pytest.mark.parametrize("in_arena", [True, False])
def test_batched_scatter_matches_per_block(in_arena: bool) -> None:
    fp = bytes(32)
    torch.manual_seed(0)
    kvs = [torch.randn(L, 2, H, CHUNK, D).to(torch.bfloat16) for _ in range(4)]
    # chunk 0 overlaps the local cache up to token 5; chunk 3 stops before the last token;
    # chunk 4 is a request's tail of 5 tokens, written whole.
    chunks = [
        ChunkLoad(f"k{i}", i * CHUNK, CHUNK, 5 if i == 0 else 0, (i + 1) * CHUNK - (i == 3))
        for i in range(4)
    ]
    kvs.append(torch.randn(L, 2, H, 5, D).to(torch.bfloat16))
    chunks.append(ChunkLoad("tail", 4 * CHUNK, 5, 0, 4 * CHUNK + 5))
    block_ids = [3, 9, 1, 14, 7, 2, 11, 5, 8, 4]
    fast = _connector(_caches())
    if in_arena:  # laid out as StoreClient.batch_get_chunks reads them: back to back
        blobs = [kvformat.encode(kv, fp, f"k{i}") for i, kv in enumerate(kvs)]
        fast._arena = bytearray(b"".join(blobs))
        fast._arena_tensor = torch.frombuffer(fast._arena, dtype=torch.uint8)
        view, got, off = memoryview(fast._arena), [], 0
        for b in blobs:
            got.append(kvformat.decode(view[off : off + len(b)], fp)[1])
            off += len(b)
        stacked = fast._stacked(got[1:3])
        assert stacked.data_ptr() == got[1].data_ptr()  # a view of the arena, not a copy
        assert torch.equal(stacked, torch.stack(got[1:3]))
    else:
        got = [kv.clone() for kv in kvs]
    fast._scatter_all(list(zip(chunks, got, strict=True)), block_ids)
    slow = _connector(_caches())
    for chunk, kv in zip(chunks, kvs, strict=True):
        slow._scatter(kv, chunk, block_ids)
    for a, b in zip(fast._caches, slow._caches, strict=True):
        assert torch.equal(a, b)
    assert any(c.abs().sum() > 0 for c in fast._caches)
