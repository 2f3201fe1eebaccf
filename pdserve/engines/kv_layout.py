"""Where vLLM keeps K and V inside one layer's paged KV cache, taken from vLLM, not assumed.

vLLM 0.32 hands a connector each layer's cache as a logical ``[blocks, kv_heads, block_size,
content]`` tensor (``vllm.v1.kv_cache_interface.create_kv_cache_views``); the physical order is
the cache group's :class:`vllm.v1.kv_cache_layout.KVCacheLayout` stride permutation, which the
tensor's strides already carry. What ``content`` holds depends on the backend:

- GPU backends (FlashAttention, FlashInfer, Triton, ...): K then V, ``head_dim`` each; their
  forward reads ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``. Any stride order (NHD,
  HND, block- or layer-outermost) is a strided view: :func:`content_layout`.
- The CPU backend: one head's block is ``block_size * 2 * head_dim`` contiguous elements that
  its attention ISA (``amx``, ``vec``, ``vec16``, ``neon``, ...) arranges its own way (``amx``
  pairs neighbouring elements for its tiles). :func:`cpu_layout` derives the arrangement by
  writing known values with vLLM's own cache-write op in that ISA and reading where they
  landed, then finds strides that reproduce every position: a new ISA or a changed kernel is
  either derived or refused here (:class:`LayoutError`), never stored wrong.

A :class:`BlockLayout` gives K and V as views ``[blocks, kv_heads, t_hi, t_lo, d_hi, d_lo]``
(token ``t = t_hi * t_lo_size + t_lo``, dim likewise) and :meth:`BlockLayout.factor` turns a
canonical ``[..., block_size, head_dim]`` tensor into the same shape, so gathers and scatters
between the paged cache and pdserve's canonical chunk (``[layers, 2, kv_heads, tokens,
head_dim]``) are strided copies with no per-element index.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: Values written per pass when deriving a CPU layout: small integers, exact in every KV dtype
#: (bfloat16 holds integers up to 256 exactly).
_DIGIT_BASE = 200


class LayoutError(ValueError):
    """vLLM's KV layout is one the connector cannot convert: the engine serves without the
    store (see :mod:`pdserve.engines.vllm_connector`)."""


@dataclass(frozen=True)
class PartLayout:
    """Where K (or V) lies in one head's block: ``offset`` and strides (elements) of the token
    axis split into ``(t_hi, t_lo)`` and the dim axis into ``(d_hi, d_lo)``."""

    offset: int
    t_lo: int
    d_lo: int
    strides: tuple[int, int, int, int]


@dataclass(frozen=True)
class BlockLayout:
    """One layer's K/V placement (see the module docstring). ``parts`` is ``None`` for the
    content layout, whose strides come from each cache tensor."""

    name: str
    block_size: int
    head_dim: int
    parts: tuple[PartLayout, PartLayout] | None = None

    def _parts(self, cache: torch.Tensor) -> tuple[PartLayout, PartLayout]:
        if cache.dim() != 4 or cache.shape[2] != self.block_size:
            raise LayoutError(
                f"expected a [blocks, kv_heads, {self.block_size}, content] cache, got "
                f"{tuple(cache.shape)}"
            )
        if cache.shape[3] != 2 * self.head_dim:
            raise LayoutError(
                f"cache content {cache.shape[3]} is not K and V of head_dim {self.head_dim}"
            )
        if self.parts is not None:
            if cache.stride()[2:] != (2 * self.head_dim, 1):
                raise LayoutError(
                    f"{self.name}: a head's block is not contiguous (strides {cache.stride()})"
                )
            return self.parts
        s_n, s_c = cache.stride()[2:]
        return (
            PartLayout(0, 1, 1, (s_n, 0, s_c, 0)),
            PartLayout(self.head_dim * s_c, 1, 1, (s_n, 0, s_c, 0)),
        )

    def views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``cache`` as ``[blocks, kv_heads, t_hi, t_lo, d_hi, d_lo]`` views."""
        blocks, heads = cache.shape[:2]
        s_b, s_h = cache.stride()[:2]
        out = []
        for part in self._parts(cache):
            shape = (
                blocks,
                heads,
                self.block_size // part.t_lo,
                part.t_lo,
                self.head_dim // part.d_lo,
                part.d_lo,
            )
            out.append(
                cache.as_strided(
                    shape, (s_b, s_h, *part.strides), cache.storage_offset() + part.offset
                )
            )
        return out[0], out[1]

    def factor(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """``x [..., block_size, head_dim]`` (a view) shaped as :meth:`views`' trailing axes
        for K (``part`` 0) or V (1)."""
        t_lo, d_lo = (
            (1, 1) if self.parts is None else (self.parts[part].t_lo, self.parts[part].d_lo)
        )
        return x.unflatten(-1, (self.head_dim // d_lo, d_lo)).unflatten(
            -3, (self.block_size // t_lo, t_lo)
        )

    def gather(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The blocks ``block_ids`` of ``cache``, canonical: ``[n, 2, kv_heads, block_size,
        head_dim]`` (a new tensor)."""
        heads = cache.shape[1]
        out = torch.empty(
            (len(block_ids), 2, heads, self.block_size, self.head_dim),
            dtype=cache.dtype,
            device=cache.device,
        )
        for part, view in enumerate(self.views(cache)):
            self.factor(out[:, part], part).copy_(view.index_select(0, block_ids))
        return out

    def scatter(self, cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Writes canonical ``src [n, 2, kv_heads, block_size, head_dim]`` into the blocks
        ``block_ids`` of ``cache``."""
        for part, view in enumerate(self.views(cache)):
            view[block_ids] = self.factor(src[:, part], part)


def content_layout(block_size: int, head_dim: int) -> BlockLayout:
    """The GPU backends' layout: K then V along the content axis, in any stride order."""
    return BlockLayout("content", block_size, head_dim)


#: ``write(key, value, key_cache, value_cache, slots)``: vLLM's cache-write op in one ISA.
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def vllm_cpu_writer(isa: str, kv_cache_dtype: str = "auto") -> CacheWriter:
    """vLLM's CPU cache-write op (``cpu_attn_reshape_and_cache``) in ``isa``."""
    from vllm import _custom_ops as ops

    def write(key, value, key_cache, value_cache, slots):  # type: ignore[no-untyped-def]
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, isa, kv_cache_dtype=kv_cache_dtype
        )

    return write


def vllm_cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int, kv_cache_dtype: str) -> str:
    """The attention ISA vLLM's CPU backend picks for this cache (its own function)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:  # moved in a newer vLLM: refuse rather than guess
        raise LayoutError(f"cannot tell vLLM's CPU attention ISA: {exc}") from exc
    return str(_get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype))


@functools.cache
def cpu_isa_runs(isa: str) -> bool:
    """Whether this machine's vLLM build runs ``isa``'s kernels: its cache write answers
    "Unsupported CPU attention configuration" for ``amx`` on a CPU without AMX/AVX-512, which
    never picks it (:func:`vllm_cpu_isa`). Any other refusal counts as running (the caller
    then sees it)."""
    try:
        cpu_layout(torch.bfloat16, 32, 32, isa)
    except LayoutError as exc:
        return "Unsupported CPU attention configuration" not in str(exc)
    return True


def cpu_layout(
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    isa: str,
    *,
    kv_cache_dtype: str = "auto",
    write: CacheWriter | None = None,
) -> BlockLayout:
    """The CPU backend's layout for ``isa``, derived from its cache-write op (``write``,
    default vLLM's). Raises :class:`LayoutError` when the op refuses the configuration or
    the arrangement is not one strided view per K and V."""
    if kv_cache_dtype not in ("auto", str(dtype).removeprefix("torch.")):
        raise LayoutError(f"kv_cache_dtype {kv_cache_dtype!r}: quantized KV is not converted")
    write = write or vllm_cpu_writer(isa, kv_cache_dtype)
    heads = 2  # two heads: a head's block must be independent of the other's
    area = block_size * 2 * head_dim
    total = heads * area  # (part, head, token, dim) positions: K and V of every head
    where = torch.zeros((heads, area), dtype=torch.long)
    scale = 1
    while scale < total:
        # each pass writes one base-200 digit of every element's canonical index
        digit = (torch.arange(total) // scale) % _DIGIT_BASE
        kv = digit.view(2, heads, block_size, head_dim).transpose(1, 2).to(dtype)
        scratch = torch.full((1, heads, block_size, 2 * head_dim), -1.0, dtype=dtype)
        key_cache, value_cache = scratch.view(1, heads, 2 * block_size, head_dim).chunk(2, dim=2)
        try:
            write(kv[0].contiguous(), kv[1].contiguous(), key_cache, value_cache,
                  torch.arange(block_size))  # fmt: skip
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            raise LayoutError(f"vLLM's CPU cache write refuses isa {isa!r}: {exc}") from exc
        got = scratch.view(heads, area).float()
        if (got < 0).any():
            raise LayoutError(f"isa {isa!r} leaves block positions unwritten")
        where += got.long() * scale
        scale *= _DIGIT_BASE
    # where[h, m]: the canonical index stored at memory position m of head h's block
    pos = torch.full((total,), -1, dtype=torch.long)
    mem = torch.arange(heads * area)
    pos[where.flatten()] = mem
    if (pos < 0).any():
        raise LayoutError(f"isa {isa!r} does not store every K/V element once")
    pos = pos.view(2, heads, block_size, head_dim)
    if heads > 1 and not torch.equal(pos[:, 1] - pos[:, 0], torch.full_like(pos[:, 0], area)):
        raise LayoutError(f"isa {isa!r} mixes heads within a block")
    parts = tuple(_factor(pos[p, 0], isa) for p in range(2))
    return BlockLayout(f"cpu:{isa}", block_size, head_dim, parts)  # type: ignore[arg-type]


def engine_layout(
    vllm_config: Any, dtype: torch.dtype, block_size: int, head_dim: int
) -> BlockLayout:
    """The layout of the caches a vLLM engine of ``vllm_config`` allocates (``dtype``,
    ``block_size`` and ``head_dim`` of its KV cache): on a CPU platform the ISA its attention
    layers run (their ``isa``, else the one vLLM's backend picks for this cache), derived from
    vLLM's op; on a GPU the content layout. Raises :class:`LayoutError`."""
    from vllm.platforms import current_platform

    kv_cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if not current_platform.is_cpu():
        if kv_cache_dtype != "auto":
            raise LayoutError(f"kv_cache_dtype {kv_cache_dtype!r}: quantized KV is not converted")
        return content_layout(block_size, head_dim)
    isa = _layers_isa(vllm_config) or vllm_cpu_isa(
        vllm_config.model_config.dtype, block_size, head_dim, kv_cache_dtype
    )
    return cpu_layout(dtype, block_size, head_dim, isa, kv_cache_dtype=kv_cache_dtype)


def config_layout_error(vllm_config: Any) -> str:
    """Why the caches an engine of ``vllm_config`` will allocate cannot be converted ("" =
    they can): :func:`engine_layout` from the config alone (the model's dtype, the block size,
    the head size), for the processes that hold no cache: the connector's scheduler side
    and the worker that reports the store's state."""
    model = vllm_config.model_config
    block_size = int(vllm_config.cache_config.block_size)
    try:
        engine_layout(vllm_config, model.dtype, block_size, model.get_head_size())
    except LayoutError as exc:
        return str(exc)
    return ""


def _layers_isa(vllm_config: Any) -> str:
    """The ISA vLLM's CPU attention builder gave the engine's layers ("" before it ran, as in
    the scheduler's process, or when they disagree)."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
    except ImportError:
        return ""
    layers = get_layers_from_vllm_config(vllm_config, Attention)
    isas = {getattr(layer, "isa", "") for layer in layers.values()}
    return isas.pop() if len(isas) == 1 else ""


def _factor(offsets: torch.Tensor, isa: str) -> PartLayout:
    """Strides reproducing ``offsets [block_size, head_dim]`` (memory position of each token
    and dim) with the token and dim axes each split in two, the smallest splits first."""
    bs, dim = offsets.shape
    t = torch.arange(bs).view(bs, 1)
    d = torch.arange(dim).view(1, dim)
    base = int(offsets[0, 0])
    for t_lo in _divisors(bs):
        for d_lo in _divisors(dim):
            at = lambda i, j: int(offsets[i, j]) - base  # noqa: E731
            strides = (
                at(t_lo, 0) if t_lo < bs else 0,
                at(1, 0) if t_lo > 1 else 0,
                at(0, d_lo) if d_lo < dim else 0,
                at(0, 1) if d_lo > 1 else 0,
            )
            predicted = (
                base
                + (t // t_lo) * strides[0]
                + (t % t_lo) * strides[1]
                + (d // d_lo) * strides[2]
                + (d % d_lo) * strides[3]
            )
            if torch.equal(predicted, offsets):
                return PartLayout(base, t_lo, d_lo, strides)
    raise LayoutError(f"isa {isa!r} arranges a block in a way no strided view reproduces")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
