"""``pdserve decode`` configuration: the shared worker fields (pdserve.services.worker.config.WorkerConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.worker.config import WorkerConfig


@dataclass
class DecodeConfig(WorkerConfig):
    """Decode worker: engine + server fields; ``max_num_seqs`` generations run at once and up
    to ``max_queue`` more wait."""
