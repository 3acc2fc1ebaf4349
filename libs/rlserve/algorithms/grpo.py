"""GRPO (Shao et al. 2024, arXiv:2402.03300) and the RL runs built like it: the algorithm's step.

Beside the steps runs the producer (`rlserve.trajectories.producer`): it plays each step's prompts as
groups of trajectories as soon as the staleness bound allows and queues them. A step takes the next
produced step's groups; drops the stale ones (older than the bound), those an environment or a reward
plug-in failed on, and (by default) those whose samples all scored alike (after DAPO's overlong
reward shaping, when on) where the estimator is group-relative; computes advantages
(`grpo.adv_estimator`, `rlserve.algorithms.advantages`); trains on the rest with `loss_fn`
(`rlserve.algorithms.losses`); and publishes the new weights to the rollout engines. Every dropped
trajectory is counted in the ledger with its reason; a step left with nothing to train is skipped
with a WARNING event and moves the policy by no version.

With `sft.enabled` an SFT warm start (`sft.py`) comes first; its output is the initial policy and the
KL reference.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import torch

from rlserve.algorithms.dynamic_sampling import zero_variance_groups
from rlserve.algorithms.registry import advantage_estimator
from rlserve.algorithms.reward_shaping import overlong_penalty
from rlserve.algorithms.sft import sft_warm_start
from rlserve.config import RunSpec
from rlserve.data.dataset import PromptSampler, build_splits
from rlserve.loop.algorithm import Algorithm, AttemptView
from rlserve.trajectories.batch import advantage_inputs, build_batch
from rlserve.trajectories.metrics import completion_metrics, engine_idle, episode_metrics, reward_metrics
from rlserve.trajectories.producer import Producer, ProducerState
from rlserve.trajectories.queue import ProducedStep, StepQueue, saved_steps, summarize_errors
from rlserve.trajectories.staleness import StalenessBound
from rlserve.trajectories.trajectory import Group
from rlserve.v1 import coordinator_pb2 as pb

# Reward-error messages shown per step in the DROPPED event; the rest are only counted.
ERROR_MESSAGES_PER_STEP = 3


def shaped_rewards(groups: list[Group], rewards: torch.Tensor, spec: RunSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """The rewards advantages are computed from: the task's, plus DAPO's overlong penalty when
    `grpo.reward_shaping` is on (`rlserve.algorithms.reward_shaping`)."""
    cfg = spec.grpo.reward_shaping
    if not cfg.enabled or not groups:
        return rewards, {}
    lengths = torch.tensor([[t.policy_tokens for t in g.trajectories] for g in groups])
    penalty = overlong_penalty(lengths, spec.max_response_length, cfg.overlong_buffer_length,
                               cfg.overlong_buffer_penalty)
    shaped = rewards + penalty
    return shaped, {"reward/overlong_penalty_mean": penalty.mean().item(),
                    "reward/overlong_penalized_fraction": (penalty < 0).float().mean().item(),
                    "reward/shaped_mean": shaped.mean().item()}


class Grpo(Algorithm):
    unit = "trajectories"
    samples_from_policy = True

    def __init__(self, attempt: AttemptView):
        super().__init__(attempt)
        spec = attempt.inputs.spec
        self.producer_state = ProducerState(PromptSampler(list(attempt.inputs.train), spec.data.seed))
        learner_on_cpu = spec.cluster.device == "cpu" or (spec.cluster.device == "auto"
                                                         and spec.cluster.gpus_per_worker == 0)
        self.cores_shared = attempt.settings.generation_shares_cpu_cores and learner_on_cpu
        self.queue = StepQueue(StalenessBound(spec.grpo.max_age(self.cores_shared)))
        self.activity_mark: dict = {}  # engine activity at the previous step

    @classmethod
    def data(cls, spec: RunSpec) -> tuple[list, list]:
        splits = build_splits(spec.data)
        return splits.train, splits.val[: spec.grpo.max_val_samples]

    @property
    def data_cursor(self) -> int:
        return self.producer_state.data_cursor

    async def prepare(self) -> Path:
        spec = self.attempt.inputs.spec
        if spec.grpo.async_grpo.enabled == "auto":
            self.attempt.run.emit(pb.EVENT_KIND_INFO, "async_grpo.enabled auto: " + (
                "sync, generation and training share the CPU cores" if self.cores_shared else
                f"async, max trajectory age {spec.grpo.max_age(self.cores_shared)}"))
        if spec.sft.enabled:
            return await sft_warm_start(self.attempt)
        return self.attempt.inputs.model_path

    async def reference_model(self) -> Path:
        """Whose logprobs the reference service computes: the policy the run started from."""
        return self.attempt.state.init_model

    async def background(self) -> list[Coroutine[Any, Any, None]]:
        a = self.attempt
        producer = Producer(a.inputs, a.run, a.services, self.producer_state, self.queue,
                            await self.reference_model(), a.progress)
        return [producer.run_steps()]

    def validates_at_start(self) -> bool:
        return self.attempt.inputs.spec.grpo.val_at_start

    def validation_due(self, steps_done: int) -> bool:
        period = self.attempt.inputs.spec.grpo.val_period
        return bool(period) and (steps_done % period == 0 or steps_done == self.max_steps)

    def after_step(self, steps_done: int, version: int) -> None:
        self.queue.advance(steps_done, version)

    def checkpoint_state(self) -> dict[str, Any]:
        """What the producer had made and queued (nothing counted as generated is lost by a resume)."""
        queued = self.queue.snapshot()
        in_flight = self.attempt.run.ledger.in_flight
        if sum(s.size for s in queued) != in_flight:
            raise RuntimeError(f"checkpoint: {in_flight} trajectories in flight but "
                               f"{sum(s.size for s in queued)} queued")
        return {"produced_steps": self.producer_state.produced_steps,
                "reward_version": self.producer_state.reward_version,
                "buffer": [dataclasses.asdict(s) for s in queued]}

    def restore(self, data_cursor: int, saved: dict[str, Any]) -> str:
        queued = saved_steps(saved["buffer"])
        producer = self.producer_state
        producer.produced_steps, producer.reward_version = saved["produced_steps"], saved["reward_version"]
        producer.sampler.seek(data_cursor)
        producer.data_cursor = data_cursor
        self.queue.load(queued, self.attempt.state.step, self.attempt.state.version)
        return f"{sum(len(s.groups) for s in queued)} buffered groups"

    def _drop(self, groups: list[Group], reason: str, detail: str = "") -> int:
        """Count `groups` as dropped and announce it; returns how many trajectories that was."""
        if not groups:
            return 0
        n = sum(g.size for g in groups)
        self.attempt.run.drop(reason, n, f"dropped {len(groups)} groups ({n} trajectories): {reason}"
                              + (f": {detail}" if detail else ""))
        return n

    def _drop_failed(self, groups: list[Group]) -> tuple[list[Group], Counter]:
        """Drop the groups an environment or a reward plug-in failed on, quoting their messages."""
        dropped: Counter = Counter()
        env_failed = [g for g in groups if g.env_failures]
        for reason in sorted({g.env_failures[0][0] for g in env_failed}):
            mine = [g for g in env_failed if g.env_failures[0][0] == reason]
            dropped[reason] = self._drop(mine, reason, summarize_errors(
                [msg for g in mine for _, msg in g.env_failures], ERROR_MESSAGES_PER_STEP))
        errored = [g for g in groups if not g.env_failures and g.reward_errors]
        dropped["reward_error"] = self._drop(errored, "reward_error", summarize_errors(
            [m for g in errored for m in g.reward_errors], ERROR_MESSAGES_PER_STEP))
        return [g for g in groups if not g.env_failures and not g.reward_errors], dropped

    def _batch_metrics(self, produced: ProducedStep, fresh: list[Group], scored: list[Group], rewards: torch.Tensor,
                       version: int) -> dict[str, float]:
        spec, bound = self.attempt.inputs.spec, self.queue.bound
        ages = [bound.age(version, g.weight_version) for g in fresh]
        seen = dict(self.producer_state.activity)
        metrics = {**produced.metrics, **reward_metrics(rewards, scored),
                   "batch/staleness_mean": sum(ages) / max(1, len(ages)),
                   "batch/staleness_max": float(max(ages, default=0)),
                   "batch/mixed_version_samples": float(sum(g.mixed_samples for g in fresh)),
                   "batch/version_spread_max": float(max((g.version_spread for g in fresh), default=0)),
                   "data/cursor": float(produced.data_cursor),
                   **completion_metrics(fresh), **episode_metrics(fresh),
                   **engine_idle(seen, self.activity_mark, produced.metrics.get("usage/generated_tokens", 0.0)
                                 if spec.shares_deployed_base else None)}
        if "usage/generation_device_s" not in metrics:  # no earlier mark (the run's first step): the calls' engine time
            metrics["usage/generation_device_s"] = produced.metrics.get("timing/generate_s", 0.0) - \
                produced.metrics.get("plumbing/generate_s", 0.0)
        self.activity_mark = seen
        return metrics

    async def step(self, step: int) -> dict[str, float]:
        """Take groups -> filter -> advantages -> train -> sync weights."""
        a, spec, bound = self.attempt, self.attempt.inputs.spec, self.queue.bound
        t0 = time.perf_counter()
        version = a.state.version

        # 1. This step's groups; the stale ones (older than the bound) and those an environment or a reward
        #    plug-in failed on are dropped, never trained.
        produced = await self.queue.take()
        wait_s = time.perf_counter() - t0
        fresh = [g for g in produced.groups if bound.is_fresh(version, g.weight_version)]
        stale = [g for g in produced.groups if not bound.is_fresh(version, g.weight_version)]
        dropped = Counter({"stale": self._drop(stale, "stale")})
        scored, failed = self._drop_failed(fresh)
        dropped.update(failed)
        rewards = torch.tensor([g.rewards for g in scored], dtype=torch.float32)
        metrics = self._batch_metrics(produced, fresh, scored, rewards, version)
        metrics["timing/wait_for_rollouts_s"] = wait_s

        # 2. Advantages; groups whose samples all scored alike (after reward shaping) carry no signal where the
        # estimator is group-relative (not REINFORCE++'s batch normalisation, nor a distillation teacher's).
        shaped, shaping_metrics = shaped_rewards(scored, rewards, spec)
        metrics.update(shaping_metrics)
        estimator = advantage_estimator(spec.grpo.adv_estimator, spec.loss_fn)
        keep = torch.ones(len(scored), dtype=torch.bool)
        if spec.grpo.skip_zero_advantage_groups and scored and estimator.group_relative:
            keep = ~zero_variance_groups(shaped)
            dropped["zero_advantage"] = self._drop([g for g, k in zip(scored, keep.tolist()) if not k],
                                                   "zero_advantage")
        trainable = [g for g, k in zip(scored, keep.tolist()) if k]
        metrics["batch/groups_trained"] = float(len(trainable))
        metrics["batch/trajectories_trained"] = float(sum(g.size for g in trainable))
        if not trainable:
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(dropped.items()) if n)
            a.run.emit(pb.EVENT_KIND_WARNING, f"step {step + 1} skipped: no trainable group (trajectories "
                       f"dropped: {reasons}); the policy stays at version {version}")
            return metrics
        adv_inputs = advantage_inputs(trainable, shaped[keep], estimator.needs_reference_logprobs)
        advantages = estimator(adv_inputs)
        metrics.update(estimator.metrics(adv_inputs))

        # 3. Train on the batch.
        batch = build_batch(trainable, advantages, spec.reference_to_learner, version)
        t1 = time.perf_counter()
        result = await a.train(batch, spec.loss_fn.name)
        train_s = time.perf_counter() - t1
        metrics.update(result.metrics)
        metrics["timing/train_s"] = train_s
        metrics["plumbing/train_s"] = train_s - result.metrics.get("perf/learner_step_seconds", train_s)

        # 4. New weights to the generator.
        metrics.update(await a.sync.publish())
        metrics["timing/step_s"] = time.perf_counter() - t0
        return metrics
