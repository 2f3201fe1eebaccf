"""Per-service entry points and servicers (imported as ``pdserve.services``)."""
