"""What the learner's policy tests run on without Ray: in-process worker groups over real backends on the
tiny model (CPU, gloo, one rank), publishing nowhere."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlserve.learner.interfaces import LearnerBackend
from rlserve.learner.publishing import Published, Publishing
from rlserve.models import resolve_model


@dataclass
class _KeptPublisher:
    backend: LearnerBackend

    def publish(self, run_id: str, dtype: torch.dtype | None, in_flight: bool, direct: bool,
                shared_base: bool) -> Published:
        tensors = dict(self.backend.export_weights(dtype))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        return Published(self.backend.version, 1, len(tensors), size, size, 0.0, 0.0, 0.0, 0, 0)


class KeptPublishing(Publishing):
    """Publishes nowhere (the export is walked all the same); keeps which runs' adapters left the store."""

    def __init__(self) -> None:
        self.dropped: list[tuple[str, str]] = []

    def publisher(self, backend: LearnerBackend, store_name: str, bucket_bytes: int,
                  timeout_s: float) -> _KeptPublisher:
        return _KeptPublisher(backend)

    def drop_adapter(self, store_name: str, run_id: str) -> None:
        self.dropped.append((store_name, run_id))


@pytest.fixture
def publishing() -> KeptPublishing:
    return KeptPublishing()


@pytest.fixture(scope="module")
def model() -> Path:
    return resolve_model("preset:tiny")


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """The in-process worker groups' torch.distributed group (world size 1), gone after each module."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
