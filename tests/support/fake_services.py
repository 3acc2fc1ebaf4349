"""An in-memory `RunServices` for unit tests of the run loop (no Ray, no Serve, no models).

It behaves like the real services where the loop relies on it: the learner
holds one session that Configure starts and that a lost worker ends (then
every learner call raises `RunStateLost`, as ABORTED does through the
retry layer); TrainStep checks `expected_weight_version` and answers a
retried step from its memory; ExportWeights publishes the learner's version
and UpdateWeights makes the rollout serve it; checkpoints are files.
Generation is seeded random tokens, and the reward is a fixed function of
the completion's text, so groups differ within themselves and runs repeat
exactly. Environments are served as the reward application serves them
(`rlserve.environments.serving` over the loader, the plug-in run in a
thread), with test environments by name in `environments`. Every call is
recorded for the tests to inspect.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from rlserve.agents.table import AgentSessions
from rlserve.config import RunSpec
from rlserve.environments import serving
from rlserve.environments.config import EnvironmentCfg
from rlserve.environments.interfaces import Environment
from rlserve.environments.loader import Environments
from rlserve.loop.services import Capacity, RunServices, RunStateLost
from rlserve.rewards.config import RewardFunctionCfg
from rlserve.rewards.loader import CombinedReward
from rlserve.security.plugins import PluginPolicy
from rlserve.training.batch import TrainBatch
from rlserve.v1 import common_pb2, environment_pb2, learner_pb2, reference_pb2, reward_pb2, rollout_pb2


@dataclass
class Calls:
    generate: list[rollout_pb2.GenerateRequest] = field(default_factory=list)
    train: list[tuple[learner_pb2.TrainStepRequest, int]] = field(default_factory=list)  # request, sequences
    batches: list[TrainBatch] = field(default_factory=list)
    reference: int = 0
    configure: int = 0
    configured: list[RunSpec] = field(default_factory=list)  # the spec of each Configure
    released: list[str] = field(default_factory=list)
    running: int = 0  # Generate calls in progress now
    peak: int = 0  # the most at once
    env_resets: int = 0
    env_steps: list[environment_pb2.StepRequest] = field(default_factory=list)


class FakeServices(RunServices):
    def __init__(self, *, generate_delay_s: float = 0.0, lose_state_at_version: int | None = None,
                 vocab: int = 16, environments: dict[str, Environment] | None = None, save_delay_s: float = 0.0):
        self.generate_delay_s = generate_delay_s
        self.save_delay_s = save_delay_s  # a learner checkpoint takes this long (the producer goes on meanwhile)
        self.environments = dict(environments or {})
        self.env_threads = serving.EnvironmentThreads(64)
        self._loaded = Environments(PluginPolicy([]), CombinedReward([RewardFunctionCfg(name="exact_match")]))
        self.lose_state_at_version = lose_state_at_version
        self.vocab = vocab
        self.calls = Calls()
        self.session: str | None = None  # the run the learner is configured for
        self.learner_version = 0
        self.published = 0
        self.served = 0
        self._last_step: tuple[int, learner_pb2.TrainStepResponse] | None = None
        self.agents = AgentSessions()  # external_agent runs' sessions, as the coordinator's table holds them

    # --- rollout -------------------------------------------------------------------------
    async def generate(self, req: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        self.calls.generate.append(req)
        self.calls.running += 1
        self.calls.peak = max(self.calls.peak, self.calls.running)
        try:
            rng = random.Random(req.sampling.seed)
            await asyncio.sleep(rng.uniform(0, self.generate_delay_s))
            completions = []
            for i, prompt in enumerate(req.prompts):
                rng = random.Random(req.sampling.seed * 7919 + i)
                samples = []
                for _ in range(req.num_samples or 1):
                    ids = [rng.randrange(3, self.vocab) for _ in range(rng.randint(1, req.sampling.max_new_tokens))]
                    samples.append(rollout_pb2.Sample(
                        token_ids=ids, logprobs=[-1.0] * len(ids), text="".join(str(t % 10) for t in ids),
                        finish_reason=common_pb2.FINISH_REASON_STOP,
                        version_runs=[rollout_pb2.VersionRun(version=self.served, start=0, end=len(ids))]))
                completions.append(rollout_pb2.Completion(prompt_token_ids=prompt.token_ids.ids, samples=samples))
            return rollout_pb2.GenerateResponse(completions=completions, weight_version=self.served,
                                                replica_id="fake", engine_seconds=0.001)
        finally:
            self.calls.running -= 1

    async def update_weights(self, req: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        assert req.version == self.published, (req.version, self.published)
        self.served = req.version
        return rollout_pb2.UpdateWeightsResponse(weight_version=req.version, replica_id="fake")

    async def rollout_info(self) -> rollout_pb2.GetInfoResponse:
        return rollout_pb2.GetInfoResponse(model="fake", engine="vllm", weight_version=self.served,
                                           max_model_len=128, vocab_size=self.vocab, dtype="float32")

    # --- reward and reference ------------------------------------------------------------
    async def score(self, req: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        results = [reward_pb2.ScoreResult(id=item.id, score=(sum(map(ord, item.completion)) % 3) / 2,
                                          status=reward_pb2.SCORE_STATUS_OK) for item in req.items]
        return reward_pb2.ScoreResponse(results=results, reward_version="fake-reward")

    def _environment(self, spec: environment_pb2.EnvironmentSpec) -> tuple[Environment, str]:
        """A test environment by name, else what the reward application would load (nothing allow-listed)."""
        cfg = EnvironmentCfg.from_proto(spec)
        if cfg.name in self.environments:
            return self.environments[cfg.name], f"fake-env-{cfg.name}"
        return self._loaded.get(spec)[0], f"fake-env-{cfg.name}"

    async def env_reset(self, req: environment_pb2.ResetRequest) -> environment_pb2.ResetResponse:
        self.calls.env_resets += 1
        env, version = self._environment(req.environment)
        return await self.env_threads.reset(env, version, req)

    async def env_step(self, req: environment_pb2.StepRequest) -> environment_pb2.StepResponse:
        self.calls.env_steps.append(req)
        env, version = self._environment(req.environment)
        return await self.env_threads.step(env, version, req)

    async def reference_logprobs(self, req: reference_pb2.LogProbsRequest) -> reference_pb2.LogProbsResponse:
        self.calls.reference += 1
        return reference_pb2.LogProbsResponse(sequences=[
            reference_pb2.SequenceLogProbs(logprobs=[-1.5] * (len(s.token_ids) - s.prompt_length))
            for s in req.sequences])

    def agent_sessions(self) -> AgentSessions:
        return self.agents

    # --- learner ---------------------------------------------------------------------------
    def _require(self, run_id: str) -> None:
        if self.session != run_id:
            raise RunStateLost(f"learner: ABORTED: no training session for run {run_id!r}")

    async def configure(self, req: learner_pb2.ConfigureRequest, spec: RunSpec) -> learner_pb2.ConfigureResponse:
        self.calls.configure += 1
        self.calls.configured.append(spec)
        self.session, self.learner_version, self._last_step = req.run_id, 0, None
        return learner_pb2.ConfigureResponse(backend="fake", world_size=1, parallel_layout="dp=1",
                                             num_parameters=1000, device="cpu")

    async def train_step(self, req: learner_pb2.TrainStepRequest, batch: TrainBatch) -> learner_pb2.TrainStepResponse:
        self._require(req.run_id)
        if self.lose_state_at_version is not None and self.learner_version == self.lose_state_at_version:
            self.lose_state_at_version, self.session = None, None  # a worker died: the session is gone
            raise RunStateLost("learner.TrainStep: ABORTED: a learner worker died")
        if req.HasField("expected_weight_version") and req.expected_weight_version != self.learner_version:
            raise AssertionError(f"step expects version {req.expected_weight_version}, learner at "
                                 f"{self.learner_version}")
        self.calls.train.append((req, batch.num_seqs))
        self.calls.batches.append(batch)
        self.learner_version += 1
        return learner_pb2.TrainStepResponse(weight_version=self.learner_version, metrics={
            "loss/total": 0.5, "perf/learner_step_seconds": 0.001})

    async def export_weights(self, req: learner_pb2.ExportWeightsRequest) -> learner_pb2.ExportWeightsResponse:
        self._require(req.run_id)
        self.published = self.learner_version
        return learner_pb2.ExportWeightsResponse(weight_version=self.published, num_buckets=1, num_tensors=2,
                                                 num_bytes=1024)

    async def save_checkpoint(self, req: learner_pb2.SaveCheckpointRequest) -> learner_pb2.SaveCheckpointResponse:
        self._require(req.run_id)
        await asyncio.sleep(self.save_delay_s)
        Path(req.path).mkdir(parents=True, exist_ok=True)
        Path(req.path, "state.json").write_text(json.dumps({"version": self.learner_version}))
        if req.hf_path:
            Path(req.hf_path).mkdir(parents=True, exist_ok=True)
            Path(req.hf_path, "config.json").write_text("{}")
        return learner_pb2.SaveCheckpointResponse(path=req.path, weight_version=self.learner_version)

    async def load_checkpoint(self, req: learner_pb2.LoadCheckpointRequest) -> learner_pb2.LoadCheckpointResponse:
        self._require(req.run_id)
        self.learner_version = json.loads(Path(req.path, "state.json").read_text())["version"]
        return learner_pb2.LoadCheckpointResponse(weight_version=self.learner_version)

    async def release_learner(self, run_id: str) -> None:
        if self.session == run_id:
            self.session = None
        self.calls.released.append(run_id)

    async def capacity(self) -> Capacity:
        return Capacity(cpus=8.0, gpus=0.0, node_cpus=8.0)
