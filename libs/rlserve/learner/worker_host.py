"""One learner rank: a backend per run it trains, without Ray.

A `WorkerGroup` (`rlserve.learner.worker_group`) holds one `WorkerHost` per
rank, each in a process whose torch.distributed group it set up before, and
calls the same method on every rank in one order, so the ranks' collectives
match. Runs on the deployed base (`shared_base`) share a host and its frozen
base (`rlserve.learner.shared_base`). Weight sync goes through `Publishing`
(`rlserve.learner.publishing`): rank 0 sends each version, the other ranks only
join the export's gathers.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlserve.config import RunSpec
from rlserve.dtypes import torch_dtype
from rlserve.learner.interfaces import BackendInfo, LearnerBackend, StepResult
from rlserve.learner.publishing import Published, Publishing, WeightPublisher
from rlserve.learner.registry import make_backend
from rlserve.learner.shared_base import SharedBases
from rlserve.training.batch import TrainBatch
from rlserve.training.primitives import AdamStep, DatumBatch, PrimitiveResult


@dataclass
class _RunOnWorker:
    spec: RunSpec
    backend: LearnerBackend
    shared_base: bool
    publisher: WeightPublisher | None = None
    store_name: str = ""


class WorkerHost:
    """A rank's runs, each a backend; every method is called on every rank of the group in one order."""

    def __init__(self, rank: int, device: torch.device, publishing: Publishing):
        self.rank, self.device, self.publishing = rank, device, publishing
        self.runs: dict[str, _RunOnWorker] = {}
        self.bases = SharedBases()

    def configure(self, run_id: str, spec: RunSpec, model_path: Path, init_adapter: Path | None,
                  shared_base: bool) -> BackendInfo:
        """The run's backend on `model_path` (its state from before, if any, goes); with `shared_base` its
        frozen base is the one this rank already holds for other runs of that base."""
        self.release(run_id)
        torch.manual_seed(spec.grpo.seed)
        key = (str(model_path.resolve()), spec.policy.precision, str(self.device))
        shared = self.bases.for_run(key, run_id) if shared_base else None
        backend = make_backend(spec, model_path, self.device, init_adapter, shared)
        self.runs[run_id] = _RunOnWorker(spec, backend, shared_base)
        return backend.info()

    def _run(self, run_id: str) -> _RunOnWorker:
        run = self.runs.get(run_id)
        if run is None:
            raise KeyError(f"run {run_id!r} has no training session on this worker")
        return run

    def train_step(self, run_id: str, batch: TrainBatch, loss_name: str, lr: float | None) -> StepResult:
        return self._run(run_id).backend.train_step(batch, loss_name, lr)

    def forward_primitive(self, run_id: str, batch: DatumBatch, backward: bool) -> PrimitiveResult:
        """With `perf/seconds`: this rank's time on the call (what its caller is metered)."""
        t0 = time.perf_counter()
        out = self._run(run_id).backend.forward_primitive(batch, backward)
        return PrimitiveResult(out.logprobs, {**out.metrics, "perf/seconds": time.perf_counter() - t0})

    def optim_step(self, run_id: str, step: AdamStep) -> StepResult:
        """With `perf/seconds`, as `forward_primitive`."""
        t0 = time.perf_counter()
        out = self._run(run_id).backend.optim_step(step)
        return StepResult(out.version, {**out.metrics, "perf/seconds": time.perf_counter() - t0})

    def export(self, run_id: str, store_name: str, direct: bool, in_flight: bool, timeout_s: float,
               shared_base: bool) -> Published | None:
        """Walk the export on every rank (the gathers are collective); rank 0 sends and publishes and
        says what it did (with `shared_base`, the adapter under the run's id). The other ranks only join
        the gathers: None."""
        run = self._run(run_id)
        # Unset outside a coordinator's run (which fills it from the deployed rollout): the training dtype.
        precision = run.spec.policy.generation.vllm_cfg.precision
        dtype = torch_dtype(precision) if precision else None
        if self.rank != 0:
            for _ in run.backend.export_weights(dtype):
                pass
            return None
        if run.publisher is None:
            run.publisher = self.publishing.publisher(run.backend, store_name,
                                                      run.spec.policy.refit_buffer_size_mb * 2**20, timeout_s)
            run.store_name = store_name
        return run.publisher.publish(run_id, dtype, in_flight, direct, shared_base)

    def save_checkpoint(self, run_id: str, path: Path) -> None:
        self._run(run_id).backend.save_checkpoint(path)

    def load_checkpoint(self, run_id: str, path: Path) -> int:
        return self._run(run_id).backend.load_checkpoint(path)

    def save_snapshot(self, run_id: str, path: Path) -> None:
        self._run(run_id).backend.save_snapshot(path)

    def load_snapshot(self, run_id: str, path: Path) -> int:
        return self._run(run_id).backend.load_snapshot(path)

    def save_hf(self, run_id: str, path: Path) -> None:
        self._run(run_id).backend.save_hf(path)

    def release(self, run_id: str) -> bool:
        """Drop the run's backend (its adapters, optimizer state and, with its last run, a shared base) and
        its adapter in the weight store."""
        run = self.runs.pop(run_id, None)
        if run is None:
            return False
        self.bases.release(run_id)
        if run.shared_base and run.store_name:
            self.publishing.drop_adapter(run.store_name, run_id)
        del run
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True
