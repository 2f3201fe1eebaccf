"""``pdserve prefill`` configuration: the shared worker fields (pdserve.services.worker.config.WorkerConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.worker.config import WorkerConfig


@dataclass
class PrefillConfig(WorkerConfig):
    """Prefill worker: engine + server fields; ``max_queue`` caps concurrent Prefill calls."""
