"""pdserve's KV store as an LMCache remote store, through LMCache's ``remote_storage_plugins``
mechanism (no fork of LMCache). See docs/lmcache.md.

LMCache configuration (YAML or ``LMCACHE_*`` environment)::

    remote_storage_plugins: ["pdserve"]
    extra_config:
      remote_storage_plugin.pdserve.module_path: pdserve.integrations.lmcache
      remote_storage_plugin.pdserve.class_name: PdserveConnector
      remote_storage_plugin.pdserve.master_address: 127.0.0.1:50051

Each LMCache chunk (a ``CacheEngineKey`` and its ``MemoryObj``) is one store object:

* key: ``<namespace>/<model>/<BLAKE3-256 hex of CacheEngineKey.to_string()>``. The key string
  carries the model, world size, worker id, chunk hash, dtype and tags, so every distinct
  LMCache key maps to a distinct store key, bounded in length (the master's ``max_key_bytes``).
* value: a fixed binary header, a JSON description of the chunk and its raw bytes (no pickle)::

      "PDLC" | u16 LE version (1) | u16 LE flags (0) | u32 LE JSON length | JSON | payload

  JSON: ``{"key": CacheEngineKey.to_string(), "shapes": [[...], ...], "dtypes": ["bfloat16",
  ...], "fmt": "KV_2LTD", "nbytes": len(payload)}``. A read checks the magic, the version, the
  key (a hash collision or a foreign object is a miss, never another chunk's KV) and the sizes.
  The store's own BLAKE3 object checksum (on by default) guards the bytes.

The codec (:func:`store_key`, :func:`encode_object`, :func:`decode_object`) needs neither
LMCache nor torch; ``PdserveConnector`` is built (and LMCache imported) on first access.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import logging
import math
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

import blake3

from pdserve import errors, identity
from pdserve.store.api import StoreOptions

if TYPE_CHECKING:
    from pdserve.store.api import StoreBackend

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Object header: magic, format version, flags (0), length of the JSON that follows.
MAGIC = b"PDLC"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sHHI")
#: A header longer than this is not ours (shapes and dtypes of a chunk fit in far less).
MAX_META_BYTES = 64 * 1024
#: Longest model-name part of a store key; longer names are replaced by their hash.
MAX_MODEL_KEY_BYTES = 96
#: How many written keys :meth:`PdserveConnector.list` remembers (the store cannot list).
LIST_MEMORY = 65536

#: Element sizes of the dtypes LMCache stores (torch names, without ``torch.``).
DTYPE_BYTES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
}


# -- codec (no LMCache, no torch) ------------------------------------------------------------


def store_key(namespace: str, model_name: str, key_string: str) -> str:
    """The store key of an LMCache chunk whose ``CacheEngineKey.to_string()`` is
    ``key_string``: ``<namespace>/<model>/<blake3 hex of key_string>``. Independent of
    ``PYTHONHASHSEED`` and of the process (LMCache's chunk hash itself must be too: see
    docs/lmcache.md)."""
    if not namespace or "/" in namespace:
        raise errors.InvalidArgument(f"namespace must be non-empty without '/', got {namespace!r}")
    model = model_name or "_"
    if len(model.encode()) > MAX_MODEL_KEY_BYTES:
        model = "h-" + blake3.blake3(model.encode()).hexdigest()[:32]
    return f"{namespace}/{model}/{blake3.blake3(key_string.encode()).hexdigest()}"


@dataclass(frozen=True)
class ChunkMeta:
    """What a store object says about the LMCache chunk it holds."""

    key: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    fmt: str
    nbytes: int

    def expected_nbytes(self) -> int | None:
        """Bytes the shapes and dtypes describe; None when a dtype is unknown."""
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            size = DTYPE_BYTES.get(dtype)
            if size is None:
                return None
            total += math.prod(shape) * size
        return total


def encode_object(meta: ChunkMeta, payload: Any) -> bytes:
    """Header + JSON + payload, ready for one store put."""
    view = memoryview(payload).cast("B")
    if len(view) != meta.nbytes:
        raise errors.InvalidArgument(f"payload is {len(view)} bytes, meta says {meta.nbytes}")
    if len(meta.shapes) != len(meta.dtypes) or not meta.shapes:
        raise errors.InvalidArgument("a chunk needs one dtype per shape, and at least one")
    doc = json.dumps(
        {
            "key": meta.key,
            "shapes": [list(s) for s in meta.shapes],
            "dtypes": list(meta.dtypes),
            "fmt": meta.fmt,
            "nbytes": meta.nbytes,
        },
        separators=(",", ":"),
    ).encode()
    return b"".join((_HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(doc)), doc, view))


def decode_object(
    data: Any, expected_key: str | None = None
) -> tuple[ChunkMeta, memoryview] | None:
    """``(meta, payload view)`` of a store object, or None when it is not a well-formed
    object of this format (or holds another key's chunk than ``expected_key``)."""
    view = memoryview(data).cast("B")
    if len(view) < _HEAD.size:
        return None
    magic, version, _flags, meta_len = _HEAD.unpack_from(view)
    if magic != MAGIC or version != FORMAT_VERSION or meta_len > MAX_META_BYTES:
        return None
    end = _HEAD.size + meta_len
    if len(view) < end:
        return None
    try:
        doc = json.loads(bytes(view[_HEAD.size : end]))
        meta = ChunkMeta(
            key=str(doc["key"]),
            shapes=tuple(tuple(int(d) for d in s) for s in doc["shapes"]),
            dtypes=tuple(str(d) for d in doc["dtypes"]),
            fmt=str(doc["fmt"]),
            nbytes=int(doc["nbytes"]),
        )
    except (ValueError, KeyError, TypeError):
        return None
    payload = view[end:]
    if expected_key is not None and meta.key != expected_key:
        return None
    if len(payload) != meta.nbytes or len(meta.shapes) != len(meta.dtypes):
        return None
    if any(d < 0 for s in meta.shapes for d in s):
        return None
    if meta.expected_nbytes() not in (None, meta.nbytes):
        return None
    return meta, payload


# -- plugin settings ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PluginSettings:
    """``extra_config`` keys ``remote_storage_plugin.<name>.<field>`` (docs/lmcache.md)."""

    master_address: str
    backend: str = "pdserve"
    transport: str = "auto"
    timeout_s: float = 5.0
    namespace: str = "lmcache"
    replicas: int = 1
    ttl_ms: int = 0
    soft_pin: bool = False
    io_threads: int = 4

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None, plugin_name: str) -> PluginSettings:
        extra = extra or {}
        prefix = f"remote_storage_plugin.{plugin_name}."

        def get(name: str, default: Any, conv: Callable[[Any], Any]) -> Any:
            value = extra.get(prefix + name)
            return default if value is None else conv(value)

        known = {f.name for f in fields(cls)} | {"module_path", "class_name"}
        for key in extra:
            field_name = key[len(prefix) :] if key.startswith(prefix) else None
            if field_name is not None and field_name not in known:
                close = difflib.get_close_matches(field_name, sorted(known), n=1)
                hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
                raise errors.InvalidArgument(
                    f"LMCache extra_config: unknown key {key!r}{hint}; the pdserve plugin "
                    f"takes {', '.join(prefix + k for k in sorted(known))}"
                )
        master = get("master_address", "", str)
        if not master:
            raise errors.InvalidArgument(
                f"LMCache extra_config needs {prefix}master_address (the pdserve KV master)"
            )
        settings = cls(
            master_address=master,
            backend=get("backend", cls.backend, str),
            transport=get("transport", cls.transport, str),
            timeout_s=get("timeout_s", cls.timeout_s, float),
            namespace=get("namespace", cls.namespace, str),
            replicas=get("replicas", cls.replicas, int),
            ttl_ms=get("ttl_ms", cls.ttl_ms, int),
            soft_pin=get("soft_pin", cls.soft_pin, _to_bool),
            io_threads=get("io_threads", cls.io_threads, int),
        )
        if settings.io_threads < 1:
            raise errors.InvalidArgument(f"{prefix}io_threads must be >= 1")
        store_key(settings.namespace, "m", "k")  # validates the namespace
        settings.options().validate()
        return settings

    def options(self) -> StoreOptions:
        return StoreOptions(replicas=self.replicas, ttl_ms=self.ttl_ms, soft_pin=self.soft_pin)

    def open_store(self) -> StoreBackend:
        from pdserve.store import open_store

        # mTLS the way pdserve's client commands take it: PDSERVE_TLS_CA / _CERT / _KEY in the
        # environment of the LMCache process (unset: plaintext, for a loopback-only store).
        if identity.tls() is None and any(
            os.environ.get(f"PDSERVE_TLS_{v}") for v in ("CA", "CERT", "KEY")
        ):
            identity.configure_env()
        if self.backend == "mooncake":  # Mooncake's client takes no transport or timeout
            return open_store(self.master_address, backend="mooncake")
        return open_store(self.master_address, transport=self.transport, timeout_s=self.timeout_s)


def _to_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def plugin_name_for(config: Any, cls: type) -> str:
    """The ``remote_storage_plugins`` entry whose ``module_path``/``class_name`` name ``cls``
    (LMCache builds a plugin's connector without telling it its name)."""
    extra = getattr(config, "extra_config", None) or {}
    names = list(getattr(config, "remote_storage_plugins", None) or [])
    ours = [
        n
        for n in names
        if extra.get(f"remote_storage_plugin.{n}.module_path") == cls.__module__
        and extra.get(f"remote_storage_plugin.{n}.class_name") == cls.__name__
    ]
    if len(ours) == 1:
        return ours[0]
    if not ours:
        raise errors.InvalidArgument(
            f"no remote_storage_plugins entry names {cls.__module__}.{cls.__name__}"
        )
    # Several pdserve plugins (several stores) in one config: LMCache does not say which one
    # this is; each needs its own subclass (or ConnectorAdapter) to tell them apart.
    raise errors.InvalidArgument(
        f"{len(ours)} remote_storage_plugins entries name {cls.__name__} ({', '.join(ours)}): "
        "give each its own class"
    )


# -- the LMCache connector -----------------------------------------------------------------------


def __getattr__(name: str) -> Any:
    """``PdserveConnector`` is built on first access (LMCache's plugin loader does
    ``getattr(module, class_name)``), so importing this module never loads LMCache; without
    LMCache that access raises ImportError."""
    if name == "PdserveConnector":
        cls = _connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _connector_class() -> type:
    try:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat, MemoryObj
        from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
    except ImportError as exc:
        raise ImportError(
            f"PdserveConnector needs LMCache ({exc}); install it as docs/lmcache.md says"
        ) from exc

    class PdserveConnector(RemoteConnector):
        """An LMCache ``RemoteConnector`` over a pdserve (or Mooncake) store client.

        LMCache calls the async methods on its storage manager's event loop; the blocking
        store calls run in this connector's own small thread pool so that loop never
        blocks. Reference counts of put objects are LMCache's business (its
        ``InstrumentedRemoteConnector`` drops them after ``put``)."""

        def __init__(
            self,
            loop: asyncio.AbstractEventLoop,
            local_cpu_backend: Any,
            config: Any,
            *,
            plugin_name: str | None = None,
            settings: PluginSettings | None = None,
            store: StoreBackend | None = None,
        ) -> None:
            metadata = getattr(local_cpu_backend, "metadata", None)
            if metadata is not None:
                super().__init__(config, metadata)
            else:  # scheduler role: LMCache gives no allocator; lookups still work
                self.save_chunk_meta = True
            self.loop = loop
            self.local_cpu_backend = local_cpu_backend
            self.config = config
            self.plugin_name = plugin_name or plugin_name_for(config, type(self))
            # settings: given by a remote_url (lmcache_url), else the plugin's extra_config
            self.settings = settings or PluginSettings.from_extra_config(
                getattr(config, "extra_config", None), self.plugin_name
            )
            self.options = self.settings.options()
            self.store: StoreBackend = store if store is not None else self.settings.open_store()
            self._pool = ThreadPoolExecutor(
                self.settings.io_threads, thread_name_prefix=f"lmcache-{self.plugin_name}"
            )
            self._written: OrderedDict[str, str] = OrderedDict()  # LMCache key -> store key
            self._written_lock = threading.Lock()
            self._closed = False
            log.info(
                "LMCache plugin %r: pdserve store at %s (namespace %r)",
                self.plugin_name,
                self.settings.master_address,
                self.settings.namespace,
            )

        def __repr__(self) -> str:
            return f"<PdserveConnector {self.plugin_name} {self.settings.master_address}>"

        # -- helpers ---------------------------------------------------------------------

        def store_key(self, key: CacheEngineKey) -> str:
            return store_key(self.settings.namespace, key.model_name, key.to_string())

        async def _run(self, fn: Callable[..., T], *args: Any) -> T:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

        def _encode(self, key: CacheEngineKey, memory_obj: MemoryObj) -> bytes:
            payload = memory_obj.byte_array
            meta = ChunkMeta(
                key=key.to_string(),
                shapes=tuple(tuple(int(d) for d in s) for s in memory_obj.get_shapes()),
                dtypes=tuple(str(d).removeprefix("torch.") for d in memory_obj.get_dtypes()),
                fmt=memory_obj.get_memory_format().name,
                nbytes=len(memoryview(payload).cast("B")),
            )
            return encode_object(meta, payload)

        def _remember(self, key: CacheEngineKey, skey: str) -> None:
            with self._written_lock:
                self._written[key.to_string()] = skey
                self._written.move_to_end(key.to_string())
                while len(self._written) > LIST_MEMORY:
                    self._written.popitem(last=False)

        def _get_many(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
            """(Pool thread) one batched read, each object decoded into an LMCache buffer;
            a store failure is a miss for every key."""
            try:
                blobs = self.store.batch_get([self.store_key(k) for k in keys])
            except errors.PdserveError as exc:
                log.warning("get of %d chunks failed: %s", len(keys), exc)
                return [None] * len(keys)
            return [self._to_memory_obj(k, b) for k, b in zip(keys, blobs, strict=True)]

        def _put_many(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
            """(Pool thread) encodes and writes the chunks with one batched put."""
            items = [
                (self.store_key(k), self._encode(k, m))
                for k, m in zip(keys, memory_objs, strict=True)
            ]
            self.store.batch_put(items, self.options)
            for k, (skey, _blob) in zip(keys, items, strict=True):
                self._remember(k, skey)

        def _to_memory_obj(self, key: CacheEngineKey, data: bytes | None) -> MemoryObj | None:
            """A MemoryObj from LMCache's allocator holding the object's bytes, or None."""
            if data is None:
                return None
            decoded = decode_object(data, key.to_string())
            if decoded is None:
                log.warning("store object for %s is not an LMCache chunk: a miss", key)
                return None
            meta, payload = decoded
            try:
                shapes = [torch.Size(s) for s in meta.shapes]
                dtypes = [getattr(torch, d) for d in meta.dtypes]
                fmt = MemoryFormat[meta.fmt]
            except (AttributeError, KeyError):
                log.warning("store object for %s has an unknown dtype or format", key)
                return None
            if not all(isinstance(d, torch.dtype) for d in dtypes):
                return None
            memory_obj = self.local_cpu_backend.allocate(shapes, dtypes, fmt)
            if memory_obj is None:
                log.debug("LMCache allocation failed for %s", key)
                return None
            dst = memoryview(memory_obj.byte_array).cast("B")
            if len(dst) != len(payload):
                log.warning("chunk %s: %d bytes stored, %d allocated", key, len(payload), len(dst))
                memory_obj.ref_count_down()
                return None
            dst[:] = payload
            return memory_obj

        # -- RemoteConnector -------------------------------------------------------------

        async def exists(self, key: CacheEngineKey) -> bool:
            return (await self._run(self.store.exists, [self.store_key(key)]))[0]

        def exists_sync(self, key: CacheEngineKey) -> bool:
            return self.store.exists([self.store_key(key)])[0]

        async def get(self, key: CacheEngineKey) -> MemoryObj | None:
            return (await self._run(self._get_many, [key]))[0]

        async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
            await self._run(self._put_many, [key], [memory_obj])

        async def list(self) -> list[str]:
            """LMCache key strings this connector wrote that are still in the store. The
            pdserve master has no key listing, so keys written by other processes (or more
            than :data:`LIST_MEMORY` ago) are not listed."""
            with self._written_lock:
                pairs = list(self._written.items())
            if not pairs:
                return []
            present = await self._run(self.store.exists, [s for _k, s in pairs])
            return [k for (k, _s), ok in zip(pairs, present, strict=True) if ok]

        async def close(self) -> None:
            self.close_sync()

        def close_sync(self) -> None:
            if self._closed:
                return
            self._closed = True
            self._pool.shutdown(wait=True)
            self.store.close()

        def remove_sync(self, key: CacheEngineKey) -> bool:
            return self.store.remove([self.store_key(key)]) == 1

        # batched forms: one master round trip per batch

        def support_batched_get(self) -> bool:
            return True

        async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
            return await self._run(self._get_many, list(keys))

        def support_batched_put(self) -> bool:
            return True

        async def batched_put(
            self, keys: Sequence[CacheEngineKey], memory_objs: Sequence[MemoryObj]
        ) -> None:
            await self._run(self._put_many, list(keys), list(memory_objs))

        def support_batched_contains(self) -> bool:
            return True

        def batched_contains(self, keys: list[CacheEngineKey]) -> int:
            if not keys:
                return 0
            return self.store.longest_prefix([self.store_key(k) for k in keys])

        async def batched_async_contains(
            self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
        ) -> int:
            if not keys:
                return 0
            try:
                return await self._run(self.store.longest_prefix, [self.store_key(k) for k in keys])
            except errors.PdserveError as exc:
                log.warning("lookup of %d chunks failed: %s", len(keys), exc)
                return 0

        async def batched_get_non_blocking(
            self, lookup_id: str, keys: list[CacheEngineKey]
        ) -> list[MemoryObj]:
            """The leading run of chunks that were read; later ones are released."""
            out: list[MemoryObj] = []
            broken = False
            for obj in await self.batched_get(keys):
                if broken or obj is None:
                    broken = True
                    if obj is not None:
                        obj.ref_count_down()
                    continue
                out.append(obj)
            return out

    PdserveConnector.__qualname__ = "PdserveConnector"
    return PdserveConnector
