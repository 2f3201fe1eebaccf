"""Fuzzing every public surface with hypothesis: the strategies, the invariants each answer
must keep, and a whole run (:func:`~.runner.run`). The tests (tests/fuzz) run a few dozen
cases per surface against in-process or real servers; a run from the repository root,
``.venv/bin/python -m tests.tools.fuzz --cases 10000``, sends thousands to real processes
(``--help`` for its flags). A test tool, not part of the package: it needs hypothesis (the
test extra).

Surfaces:

* ``router-http``: the OpenAI routes (JSON bodies with one hostile field, hostile JSON, raw
  garbage, hostile ``x-request-id``), /v1/models, /health, /metrics and unknown routes;
* ``router-grpc``: RouterService and grpc.health;
* ``engine``: PrefillService and DecodeService of real torch workers on the tiny model;
* ``master``: KVMasterService (incl. WatchEvents), KVNodeService and grpc.health;
* ``wire``: the master's control wire (hellos, frames, unknown methods, lying lengths);
* ``tcp``: a storage node's tcp data port, checked against a model of the protocol
  (:func:`~.tcp_port.tcp_expect`), with real data-plane grants the master handed out and hostile ones;
* ``meta``: MetaService and the Mooncake /metadata HTTP endpoint.

gRPC requests are: a valid request with one field (nested too) set to a hostile value of its
type, requests with hostile values everywhere, or raw bytes (garbage, spliced or truncated
encodings, invalid UTF-8, deep nesting) sent through a generic channel call.

Invariants, per case: the server still answers a valid request afterwards (no crash, no hang:
every call has a deadline); gRPC never answers UNKNOWN, INTERNAL, DATA_LOSS or UNAVAILABLE and
HTTP never 5xx; every error carries a message, and when the case set one field of a valid request to a
hostile value, an INVALID_ARGUMENT / OUT_OF_RANGE (HTTP 400, a per-item KV_INVALID) message
names that field.
"""
