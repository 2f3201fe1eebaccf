"""The ``pdserve`` commands that are not a service: the entry point (:mod:`.cli`), ``up`` and
its cluster, ``status``, ``certs``, ``mooncake``, ``vllm``, and the skeleton every service's
command is built with (:mod:`.service`)."""
