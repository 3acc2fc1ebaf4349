"""One learner rank as a Ray actor: a thin host around a Ray-free backend.

The actor sets up torch.distributed, builds the backend and forwards calls;
the only Ray-specific work here is weight sync (`rlserve.learner.publisher`):
rank 0 sends each version to the rollout engines and publishes the store copy.
"""

from __future__ import annotations

import os
from pathlib import Path

import ray
import torch

from rlserve.config import load_spec
from rlserve.cpu_affinity import pin_from_env
from rlserve.dtypes import torch_dtype
from rlserve.learner import make_backend
from rlserve.learner.interfaces import BackendInfo, StepResult
from rlserve.learner.publisher import Published, Publisher
from rlserve.training.batch import TrainBatch
from rlserve.training.distributed import device_for, init_process_group
from rlserve.weights.fleet import get_fleet
from rlserve.weights.store import get_store


@ray.remote
class LearnerWorker:
    def __init__(self, rank: int, world_size: int, init_method: str, device: str, torch_threads: int):
        pin_from_env()
        # At most one thread per core of this machine, whatever the spec asks (SubmitRun checks it too).
        torch_threads = min(torch_threads, os.cpu_count() or 1)
        torch.set_num_threads(torch_threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(torch_threads))
        self.rank = rank
        if device == "auto":  # the GPU Ray gave this worker (num_gpus: cluster.gpus_per_worker), if any
            device = "cuda" if ray.get_gpu_ids() else "cpu"
        self.device = device_for(device, local_rank=0)  # Ray gives each worker its own visible GPU
        init_process_group(rank, world_size, init_method, self.device)
        self.backend = None
        self.publisher: Publisher | None = None

    def configure(self, spec_yaml: str, model_path: str, init_adapter: str | None) -> BackendInfo:
        spec = load_spec(spec_yaml)
        torch.manual_seed(spec.grpo.seed)
        self.backend = make_backend(spec, Path(model_path), self.device, Path(init_adapter) if init_adapter else None)
        self.spec = spec
        return self.backend.info()

    def train_step(self, batch: TrainBatch, loss_name: str, lr: float | None) -> StepResult:
        return self.backend.train_step(batch, loss_name, lr)

    def export(self, run_id: str, store_name: str, direct: bool, in_flight: bool,
               timeout_s: float) -> Published | None:
        """Walk the export on every rank (the gathers are collective); rank 0 sends and publishes and
        says what it did. The other ranks only join the gathers: None."""
        # Unset outside a coordinator's run (which fills it from the deployed rollout): the training dtype.
        precision = self.spec.policy.generation.vllm_cfg.precision
        dtype = torch_dtype(precision) if precision else None
        if self.rank != 0:
            for _ in self.backend.export_weights(dtype):
                pass
            return None
        if self.publisher is None:
            self.publisher = Publisher(self.backend, get_store(store_name), get_fleet(store_name),
                                       self.spec.policy.refit_buffer_size_mb * 2**20, timeout_s)
        return self.publisher.publish(run_id, dtype, in_flight, direct)

    def save_checkpoint(self, path: str) -> None:
        self.backend.save_checkpoint(Path(path))

    def load_checkpoint(self, path: str) -> int:
        return self.backend.load_checkpoint(Path(path))

    def save_hf(self, path: str) -> None:
        self.backend.save_hf(Path(path))

    def version(self) -> int:
        return self.backend.version
