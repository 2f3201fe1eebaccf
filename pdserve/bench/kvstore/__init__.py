"""``pdserve bench kvstore``: data-plane throughput and latency of the KV store.

Starts a ``pdserve kvstore master`` and a ``pdserve kvstore node`` as real processes and
measures from this (a different) process, per transport and object size, in two modes:

* ``single``: one object per operation. A put is the whole client flow (BatchPutStart,
  write, BatchPutEnd); a get is ``get_into`` a preallocated buffer (BatchGetReplicaList,
  read, lease release).
* ``batch``: N objects per operation, as an engine saves and loads one prompt's chunks:
  ``batch_put`` (one BatchPutStart and one BatchPutEnd for all) and ``batch_get_into`` (one
  lookup, network reads pipelined). N is ``--batch``, fewer for big objects
  (:data:`BATCH_BYTES`).

Those gets read keys the client never looked up, so each pays its own master lookup. The
``pdserve/<transport>+lookup`` rows are what a KV connector pays: its ``longest_prefix``
timed with the gets it serves (single: one over the next 16 keys before every 16th get;
batch: the batch's, then its ``batch_get_into``), the gets then reading the locations it
answered with no master call of their own (:mod:`pdserve.store.client.locations`).

Reported: put and get GB/s (bytes moved / wall time of sequential operations) and p50/p99
latency per operation. Every system is measured ``--rounds`` times (default 3), in turn, each
store started afresh for each round, and each figure is the median across the rounds: the
machines are noisy, and a slow spell during one system's turn would otherwise decide a
ratio. Alongside: numpy memcpy of the same objects (the local limit: as many distinct
sources as the store run reads, so they are as far from the CPU caches), plain
loopback TCP with the same socket settings and nothing else (``tcp-plain``: what any tcp
transport here works against; machine noise can put a run of it below pdserve's), Mooncake Store's own client
(``put_from`` / ``get_into`` and ``batch_put_from`` / ``batch_get_into`` with registered
buffers against ``mooncake_master`` and a storage process) when Mooncake is installed,
``longest_prefix`` over 64 keys, and the control path alone: one master round trip over gRPC
and over the control wire. ``--tokens-compare`` adds pdserve's tcp against a second store whose
master runs with ``data_tokens`` off (``pdserve/tcp-notok``): what the per-range grant costs;
``--tls-compare`` adds it against a store with mutual TLS on the master's gRPC port and control
wire (``pdserve/tcp-tls``, certificates made for the run, this process a worker identity): what
``pdserve up``'s secure default costs. The tcp data port itself is never encrypted.
"""
