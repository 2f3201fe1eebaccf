"""The torch engine (``engine = "torch"``): :class:`pdserve.engines.torch_engine.engine.TorchEngine`
and its parts, one file each (see :mod:`pdserve.engines.torch_engine.engine`)."""
