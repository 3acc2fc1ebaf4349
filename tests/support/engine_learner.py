"""The library's run loop on a real rollout engine and a real learner backend, both in this process.

`EngineLearnerServices` is the in-memory services (`fake_services.FakeServices`: reward, environments,
reference) with the two parts that make the consistency contract real: `Generate` is a real engine's
(vLLM's CPU build or transformers, the samples encoded as the rollout service encodes them, routing
included), and the learner is a real backend (dtensor, one gloo rank in this process) whose
`TrainStep` measures the generator against itself and whose export reaches that engine in place, as
a weight transfer does (full weights, or with LoRA the adapter folder). `corrupt_version` corrupts one
such transfer on purpose (noise on every tensor that version carries), as a weight sync that failed
without saying so would leave the engine.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from rlserve.config import RunSpec
from rlserve.learner.interfaces import LearnerBackend
from rlserve.learner.registry import make_backend
from rlserve.rollout.interfaces import RolloutEngine
from rlserve.rollout.samples import completions_proto
from rlserve.training.batch import TrainBatch
from rlserve.training.distributed import init_process_group
from rlserve.v1 import learner_pb2, rollout_pb2
from rlserve.weights import adapter
from tests.support.fake_services import FakeServices


def corrupted(tensors: list[tuple[str, torch.Tensor]], seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Every tensor with Gaussian noise of twice its own standard deviation: garbage, as a transfer that failed
    half-way leaves an engine (half a deviation moved token_mult_prob_error only to 1.2, inside what MoE routing
    alone can do)."""
    gen = torch.Generator().manual_seed(seed)
    return [(n, t + 2.0 * t.float().std().nan_to_num(1.0) * torch.randn(t.shape, generator=gen).to(t.dtype))
            for n, t in tensors]


class EngineLearnerServices(FakeServices):
    def __init__(self, engine: RolloutEngine, model_path: Path, *, corrupt_version: int | None = None, **kw):
        super().__init__(**kw)
        self.engine, self.model_path, self.corrupt_version = engine, Path(model_path), corrupt_version
        self.backend: LearnerBackend | None = None
        self.folders = Path(tempfile.mkdtemp(prefix="rlserve-engine-learner-"))

    # --- rollout ---------------------------------------------------------------------
    async def generate(self, req: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        from services.rollout.app import sampling_from_proto

        self.calls.generate.append(req)
        prompts = [list(p.token_ids.ids) for p in req.prompts]
        sampling = replace(sampling_from_proto(req.sampling), routed_experts=req.routed_experts)
        t0 = time.perf_counter()
        outputs = await self.engine.generate(prompts, req.num_samples or 1, sampling)
        return rollout_pb2.GenerateResponse(
            completions=completions_proto(prompts, outputs), replica_id="engine",
            weight_version=min(s.oldest_version for ss in outputs for s in ss), engine_seconds=time.perf_counter() - t0)

    async def update_weights(self, req: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        self.served = req.version  # the export loaded it already (a direct transfer)
        return rollout_pb2.UpdateWeightsResponse(weight_version=req.version, replica_id="engine")

    # --- learner ---------------------------------------------------------------------
    async def configure(self, req: learner_pb2.ConfigureRequest, spec: RunSpec) -> learner_pb2.ConfigureResponse:
        init_process_group(0, 1, f"file://{tempfile.mktemp(prefix='rlserve-rendezvous-')}", torch.device("cpu"))
        await super().configure(req, spec)
        self.spec = spec
        self.backend = make_backend(spec, self.model_path, torch.device("cpu"))
        info = self.backend.info()
        return learner_pb2.ConfigureResponse(backend=info.backend, world_size=1, parallel_layout=info.parallel_layout,
                                             num_parameters=info.num_parameters, device="cpu")

    async def train_step(self, req: learner_pb2.TrainStepRequest, batch: TrainBatch) -> learner_pb2.TrainStepResponse:
        self._require(req.run_id)
        self.calls.train.append((req, batch.num_seqs))
        self.calls.batches.append(batch)
        result = self.backend.train_step(batch, req.loss_name or self.spec.loss_fn.name,
                                         req.learning_rate if req.HasField("learning_rate") else None)
        self.learner_version = result.version
        return learner_pb2.TrainStepResponse(weight_version=result.version, metrics=result.metrics)

    async def export_weights(self, req: learner_pb2.ExportWeightsRequest) -> learner_pb2.ExportWeightsResponse:
        self._require(req.run_id)
        version = self.backend.version
        tensors = [(n, t.detach().clone()) for n, t in self.backend.export_weights()]
        if version == self.corrupt_version:
            tensors = corrupted(tensors)
        if self.backend.adapter_config is not None:
            folder = self.folders / f"adapter-{version}"
            adapter.write_adapter(folder, dict(tensors), self.backend.adapter_config)
            await self.engine.load_adapter(folder, self.model_path, version, False)
        else:
            await self.engine.load_weights(tensors, version, False)
        self.published = self.served = version
        size = sum(t.numel() * t.element_size() for _, t in tensors)
        return learner_pb2.ExportWeightsResponse(weight_version=version, num_buckets=1, num_tensors=len(tensors),
                                                 num_bytes=size, model_bytes=size, direct_bytes=size, receivers=1)

    async def save_checkpoint(self, req: learner_pb2.SaveCheckpointRequest) -> learner_pb2.SaveCheckpointResponse:
        self._require(req.run_id)
        self.backend.save_checkpoint(Path(req.path))
        if req.hf_path:
            self.backend.save_hf(Path(req.hf_path))
        return learner_pb2.SaveCheckpointResponse(path=req.path, weight_version=self.backend.version)

    async def load_checkpoint(self, req: learner_pb2.LoadCheckpointRequest) -> learner_pb2.LoadCheckpointResponse:
        self._require(req.run_id)
        self.learner_version = self.backend.load_checkpoint(Path(req.path))
        return learner_pb2.LoadCheckpointResponse(weight_version=self.learner_version)

    async def close(self) -> None:
        """Leave no process group behind: a later test in this process would all-reduce over it."""
        await super().close()
        if dist.is_initialized():
            dist.destroy_process_group()
