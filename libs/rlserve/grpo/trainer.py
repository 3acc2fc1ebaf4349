"""The trainer: one GRPO step at a time, in order.

A step takes the next produced step's groups; drops the stale ones (older
than the bound), those an environment or a reward plug-in failed on, and (by default) those
whose samples all scored alike; computes advantages; trains on the rest; and
publishes the new weights to the rollout engines. Every dropped trajectory is
counted in the ledger with its reason. A step left with nothing to train is
skipped with a WARNING event.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable

import torch

from rlserve.algorithms.dynamic_sampling import zero_variance_groups
from rlserve.algorithms.registry import advantage_estimator
from rlserve.grpo.checkpoints import Checkpoints
from rlserve.grpo.episodes import episode_metrics
from rlserve.grpo.groups import Group, ProducedStep, StepQueue, summarize_errors
from rlserve.grpo.services import RunServices
from rlserve.grpo.state import Activity, ProducerState, RunInputs, TrainerState
from rlserve.grpo.sync import WeightSync
from rlserve.grpo.validation import Validator
from rlserve.runs.record import Run
from rlserve.training.batch import TrainBatch
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2

# Reward-error messages shown per step in the DROPPED event; the rest are only counted.
ERROR_MESSAGES_PER_STEP = 3


def build_batch(groups: list[Group], advantages: torch.Tensor, with_reference: bool) -> TrainBatch:
    """One sequence per sample: its prompt and completion tokens exactly as generated (episodes: with the
    observations between turns, which their loss mask leaves out of the loss)."""
    seqs, prompt_lens, advs, gen_lps, ref_lps, masks = [], [], [], [], [], []
    for g, adv in zip(groups, advantages.tolist()):
        for j, completion in enumerate(g.completions):
            seqs.append(g.prompt_ids + completion)
            prompt_lens.append(len(g.prompt_ids))
            advs.append(adv[j])
            gen_lps.append(g.gen_logprobs[j])
            masks.append(g.loss_masks[j] if g.loss_masks is not None else [True] * len(completion))
            if with_reference:
                ref_lps.append(g.ref_logprobs[j])
    multi_turn = any(g.loss_masks is not None for g in groups)
    return TrainBatch.from_sequences(seqs, prompt_lens, advs, gen_lps, ref_lps if with_reference else None,
                                     masks if multi_turn else None)


def reward_metrics(rewards: torch.Tensor) -> dict[str, float]:
    if not rewards.numel():
        return {"reward/mean": math.nan, "reward/std": 0.0, "reward/max": math.nan}
    return {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "reward/max": rewards.max().item()}


def completion_metrics(groups: list[Group], max_new_tokens: int) -> dict[str, float]:
    """Completion lengths: RL batches are long-tailed, and the longest sample sets a synchronous step's pace.
    An episode's length is its policy's tokens over all its turns (its cut turns: episode/truncated_fraction)."""
    lengths = [sum(m) for g in groups for m in g.loss_masks] if groups and groups[0].loss_masks is not None \
        else [len(c) for g in groups for c in g.completions]
    if not lengths:
        return {}
    out = {"completion/tokens_mean": sum(lengths) / len(lengths), "completion/tokens_max": float(max(lengths))}
    if groups[0].loss_masks is None:
        out["completion/clipped_fraction"] = sum(n >= max_new_tokens for n in lengths) / len(lengths)
    return out


def engine_idle(seen: Activity, before: Activity) -> dict[str, float]:
    """The rollout engines' idle share between two marks (replicas seen at both), and the part of it
    weight updates held them."""
    up, idle, paused = (sum(seen[r][i] - before[r][i] for r in seen if r in before) for i in range(3))
    return {"engine/idle_fraction": idle / up, "engine/paused_fraction": paused / up} if up > 0 else {}


class Trainer:
    def __init__(self, inputs: RunInputs, run: Run, services: RunServices, state: TrainerState,
                 producer: ProducerState, queue: StepQueue, sync: WeightSync, validator: Validator,
                 checkpoints: Checkpoints, progress: Callable[[], None]):
        self.inputs, self.run, self.services = inputs, run, services
        self.state, self.producer, self.queue = state, producer, queue
        self.sync, self.validator, self.checkpoints = sync, validator, checkpoints
        self.progress = progress

    def _drop(self, groups: list[Group], reason: str, detail: str = "") -> int:
        """Count `groups` as dropped and announce it; returns how many trajectories that was."""
        if not groups:
            return 0
        n = sum(g.size for g in groups)
        self.run.ledger.drop(reason, n)
        self.run.emit(pb.EVENT_KIND_DROPPED, f"dropped {len(groups)} groups ({n} trajectories): {reason}"
                      + (f": {detail}" if detail else ""), {f"dropped/{reason}": float(n)})
        return n

    async def step(self, step: int) -> dict[str, float]:
        """One GRPO step: take groups -> filter -> advantages -> train -> sync weights."""
        spec, bound = self.inputs.spec, self.queue.bound
        t0 = time.perf_counter()
        version = self.run.version

        # 1. This step's groups; the stale ones (older than the bound) and those a reward plug-in
        #    failed on are dropped, never trained.
        produced: ProducedStep = await self.queue.take()
        wait_s = time.perf_counter() - t0
        fresh = [g for g in produced.groups if bound.is_fresh(version, g.weight_version)]
        stale = [g for g in produced.groups if not bound.is_fresh(version, g.weight_version)]
        dropped = Counter({"stale": self._drop(stale, "stale")})
        env_failed = [g for g in fresh if g.env_failures]
        for reason in sorted({g.env_failures[0][0] for g in env_failed}):
            mine = [g for g in env_failed if g.env_failures[0][0] == reason]
            dropped[reason] = self._drop(mine, reason, summarize_errors(
                [msg for g in mine for _, msg in g.env_failures], ERROR_MESSAGES_PER_STEP))
        fresh = [g for g in fresh if not g.env_failures]
        errored = [g for g in fresh if g.reward_errors]
        dropped["reward_error"] = self._drop(errored, "reward_error", summarize_errors(
            [m for g in errored for m in g.reward_errors], ERROR_MESSAGES_PER_STEP))
        scored = [g for g in fresh if not g.reward_errors]
        rewards = torch.tensor([g.rewards for g in scored], dtype=torch.float32)
        ages = [bound.age(version, g.weight_version) for g in fresh]
        seen = dict(self.producer.activity)
        metrics = {**produced.metrics, **reward_metrics(rewards),
                   "batch/staleness_mean": sum(ages) / max(1, len(ages)),
                   "batch/staleness_max": float(max(ages, default=0)),
                   "batch/mixed_version_samples": float(sum(g.mixed_samples for g in fresh)),
                   "batch/version_spread_max": float(max((g.version_spread for g in fresh), default=0)),
                   "data/cursor": float(min(g.prompt_index for g in produced.groups)),
                   "timing/wait_for_rollouts_s": wait_s,
                   **completion_metrics(fresh, spec.policy.generation.max_new_tokens),
                   **episode_metrics(fresh),
                   **engine_idle(seen, self.state.activity_mark)}
        self.state.activity_mark = seen

        # 2. Group-relative advantages; groups whose samples all scored alike carry no signal.
        keep = torch.ones(len(scored), dtype=torch.bool)
        if spec.grpo.skip_zero_advantage_groups and scored:
            keep = ~zero_variance_groups(rewards)
            dropped["zero_advantage"] = self._drop([g for g, k in zip(scored, keep.tolist()) if not k],
                                                   "zero_advantage")
        trainable = [g for g, k in zip(scored, keep.tolist()) if k]
        metrics["batch/groups_trained"] = float(len(trainable))
        metrics["batch/trajectories_trained"] = float(sum(g.size for g in trainable))
        if not trainable:
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(dropped.items()) if n)
            self.run.emit(pb.EVENT_KIND_WARNING, f"step {step + 1} skipped: no trainable group (trajectories "
                          f"dropped: {reasons}); the policy stays at version {version}")
            return metrics
        advantages = advantage_estimator(spec.grpo.adv_estimator)(rewards[keep])

        # 3. Train on the batch.
        batch = build_batch(trainable, advantages, spec.reference_from_service)
        t1 = time.perf_counter()
        result = await self.services.train_step(learner_pb2.TrainStepRequest(
            run_id=self.inputs.run_id, loss_name=spec.loss_fn.name, expected_weight_version=version), batch)
        train_s = time.perf_counter() - t1
        metrics.update(result.metrics)
        metrics["timing/train_s"] = train_s
        metrics["plumbing/train_s"] = train_s - result.metrics.get("perf/learner_step_seconds", train_s)

        # 4. New weights to the generator.
        metrics.update(await self.sync.publish())
        metrics["timing/step_s"] = time.perf_counter() - t0
        return metrics

    async def run_steps(self) -> None:
        """Train every step up to grpo.max_num_steps, validating and checkpointing as the spec says."""
        spec, run = self.inputs.spec, self.run
        for step in range(self.state.step, spec.grpo.max_num_steps):
            metrics = await self.step(step)
            last = step + 1 == spec.grpo.max_num_steps
            if spec.grpo.val_period and ((step + 1) % spec.grpo.val_period == 0 or last):
                metrics.update(await self.validator.validate(step + 1))
            run.step = self.state.step = step + 1
            self.queue.advance(step + 1)
            run.last_metrics = {k: v for k, v in metrics.items() if isinstance(v, float)}
            run.recorder.metrics(step + 1, metrics)
            # Counted as trained only with the STEP event that announces it: a fault before this point
            # (weight sync, validation) leaves them in flight, and the rewind drops them as `recovered`.
            run.ledger.train(int(metrics["batch/trajectories_trained"]))
            run.emit(pb.EVENT_KIND_STEP, f"step {step + 1}/{spec.grpo.max_num_steps}", metrics)
            self.progress()
            if spec.checkpointing.enabled and ((step + 1) % spec.checkpointing.save_period == 0) and not last:
                await self.checkpoints.save(step + 1)
            run.save()
