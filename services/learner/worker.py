"""One learner rank as a Ray actor: a thin host around Ray-free backends, one per run it trains.

The actor sets up torch.distributed, builds each run's backend and forwards
calls; the only Ray-specific work here is weight sync (`rlserve.learner.publisher`):
rank 0 sends each version to the rollout engines and publishes the store copy.
Runs on the deployed base (`shared_base`) share these workers and their frozen
base (`rlserve.learner.shared_base`); the replica issues every call to all
ranks in one order, so the ranks' collectives match.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from rlserve.config import RunSpec, load_spec
from rlserve.cpu_affinity import place_from_env
from rlserve.dtypes import torch_dtype
from rlserve.learner import make_backend
from rlserve.learner.interfaces import BackendInfo, LearnerBackend, StepResult
from rlserve.learner.publisher import Published, Publisher
from rlserve.learner.shared_base import SharedBases
from rlserve.training.batch import TrainBatch
from rlserve.training.distributed import device_for, init_process_group
from rlserve.weights.fleet import get_fleet
from rlserve.weights.store import get_store


@dataclass
class _RunOnWorker:
    spec: RunSpec
    backend: LearnerBackend
    shared_base: bool
    publisher: Publisher | None = None
    store_name: str = ""


@ray.remote
class LearnerWorker:
    def __init__(self, rank: int, world_size: int, init_method: str, device: str, torch_threads: int):
        place_from_env()
        # At most one thread per core of this machine, whatever the spec asks (SubmitRun checks it too).
        torch_threads = min(torch_threads, os.cpu_count() or 1)
        torch.set_num_threads(torch_threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(torch_threads))
        self.rank = rank
        if device == "auto":  # the GPU Ray gave this worker (num_gpus: cluster.gpus_per_worker), if any
            device = "cuda" if ray.get_gpu_ids() else "cpu"
        self.device = device_for(device, local_rank=0)  # Ray gives each worker its own visible GPU
        init_process_group(rank, world_size, init_method, self.device)
        self.runs: dict[str, _RunOnWorker] = {}
        self.bases = SharedBases()

    def configure(self, run_id: str, spec_yaml: str, model_path: str, init_adapter: str | None,
                  shared_base: bool) -> BackendInfo:
        self.release(run_id)
        spec = load_spec(spec_yaml)
        torch.manual_seed(spec.grpo.seed)
        key = (str(Path(model_path).resolve()), spec.policy.precision, str(self.device))
        shared = self.bases.for_run(key, run_id) if shared_base else None
        backend = make_backend(spec, Path(model_path), self.device, Path(init_adapter) if init_adapter else None,
                               shared)
        self.runs[run_id] = _RunOnWorker(spec, backend, shared_base)
        return backend.info()

    def _run(self, run_id: str) -> _RunOnWorker:
        run = self.runs.get(run_id)
        if run is None:
            raise KeyError(f"run {run_id!r} has no training session on this worker")
        return run

    def train_step(self, run_id: str, batch: TrainBatch, loss_name: str, lr: float | None) -> StepResult:
        return self._run(run_id).backend.train_step(batch, loss_name, lr)

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
            run.publisher = Publisher(run.backend, get_store(store_name), get_fleet(store_name),
                                      run.spec.policy.refit_buffer_size_mb * 2**20, timeout_s)
            run.store_name = store_name
        return run.publisher.publish(run_id, dtype, in_flight, direct, shared_base)

    def save_checkpoint(self, run_id: str, path: str) -> None:
        self._run(run_id).backend.save_checkpoint(Path(path))

    def load_checkpoint(self, run_id: str, path: str) -> int:
        return self._run(run_id).backend.load_checkpoint(Path(path))

    def save_snapshot(self, run_id: str, path: str) -> None:
        self._run(run_id).backend.save_snapshot(Path(path))

    def load_snapshot(self, run_id: str, path: str) -> int:
        return self._run(run_id).backend.load_snapshot(Path(path))

    def save_hf(self, run_id: str, path: str) -> None:
        self._run(run_id).backend.save_hf(Path(path))

    def version(self, run_id: str) -> int:
        return self._run(run_id).backend.version

    def release(self, run_id: str) -> bool:
        """Drop the run's backend (its adapters, optimizer state and, with its last run, a shared base) and
        its adapter in the weight store."""
        run = self.runs.pop(run_id, None)
        if run is None:
            return False
        self.bases.release(run_id)
        if run.shared_base and run.store_name:
            ray.get(get_store(run.store_name).drop_adapter.remote(run_id))
        del run
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def memory(self) -> dict[str, float]:
        """This rank's memory (MiB): the process's resident set, and on a GPU what torch allocated."""
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        out = {"rss_mib": resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20}
        if self.device.type == "cuda":
            out["cuda_allocated_mib"] = torch.cuda.memory_allocated(self.device) / 2**20
        return out
