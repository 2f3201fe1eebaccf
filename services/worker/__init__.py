"""The worker service: one service with two roles, prefill and decode.

Every part but the servicer is shared here: the config (:mod:`.config`), the checks every
request gets (:mod:`.request`), the slot limit (:mod:`.slots`), what a worker registers with
meta (:mod:`.registration`) and the serve skeleton (:mod:`.serve`: engine, gRPC server,
/metrics, registration with live load, READY line, drain on stop). Each role
(``services/prefill``, ``services/decode``) adds only its servicer and a :class:`WorkerSpec
<.serve.WorkerSpec>` naming it.
"""
