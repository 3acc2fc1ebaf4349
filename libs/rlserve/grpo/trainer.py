"""The trainer: one GRPO step at a time, in order.

A step takes the next produced step's groups; drops the stale ones (older
than the bound), those an environment or a reward plug-in failed on, and (by default) those
whose samples all scored alike (after DAPO's overlong reward shaping, when
on); computes advantages; trains on the rest; and
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
from rlserve.algorithms.interfaces import AdvantageInputs
from rlserve.algorithms.registry import advantage_estimator
from rlserve.algorithms.reward_shaping import overlong_penalty
from rlserve.config import RunSpec
from rlserve.grpo.checkpoints import Checkpoints
from rlserve.grpo.episodes import episode_metrics
from rlserve.grpo.groups import Group, ProducedStep, StepQueue, per_sample_means, summarize_errors
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


def advantage_inputs(groups: list[Group], rewards: torch.Tensor, with_reference: bool) -> AdvantageInputs:
    """The estimator's inputs: rewards [G, n] and per-token tensors padded to the longest completion."""
    width = max(len(c) for g in groups for c in g.completions)
    shape = (len(groups), len(groups[0].completions), width)
    mask, gen = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape)
    ref = torch.zeros(shape) if with_reference else None
    for i, g in enumerate(groups):
        for j, completion in enumerate(g.completions):
            mask[i, j, :len(completion)] = True
            gen[i, j, :len(completion)] = torch.tensor(g.gen_logprobs[j])
            if ref is not None:
                ref[i, j, :len(completion)] = torch.tensor(g.ref_logprobs[j])
    return AdvantageInputs(rewards, mask, gen, ref)


def build_batch(groups: list[Group], advantages: torch.Tensor, with_reference: bool) -> TrainBatch:
    """One sequence per sample: its prompt and completion tokens exactly as generated (episodes: with the
    observations between turns, which their loss mask leaves out of the loss); `advantages` [G, n], or
    [G, n, T] from a token-level estimator."""
    seqs, prompt_lens, advs, token_advs, gen_lps, ref_lps, masks = [], [], [], [], [], [], []
    per_token = advantages.dim() == 3
    for g, adv in zip(groups, advantages.tolist()):
        for j, completion in enumerate(g.completions):
            seqs.append(g.prompt_ids + completion)
            prompt_lens.append(len(g.prompt_ids))
            if per_token:
                token_advs.append(adv[j][:len(completion)])
            else:
                advs.append(adv[j])
            gen_lps.append(g.gen_logprobs[j])
            masks.append(g.loss_masks[j] if g.loss_masks is not None else [True] * len(completion))
            if with_reference:
                ref_lps.append(g.ref_logprobs[j])
    return TrainBatch.from_sequences(seqs, prompt_lens, None if per_token else advs, gen_lps,
                                     ref_lps if with_reference else None,
                                     token_advantages=token_advs if per_token else None,
                                     loss_mask=masks if any(g.loss_masks is not None for g in groups) else None)


def shaped_rewards(groups: list[Group], rewards: torch.Tensor, spec: RunSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """The rewards advantages are computed from: the task's, plus DAPO's overlong penalty when
    `grpo.reward_shaping` is on (`rlserve.algorithms.reward_shaping`)."""
    cfg = spec.grpo.reward_shaping
    if not cfg.enabled or not groups:
        return rewards, {}
    lengths = torch.tensor([[len(c) for c in g.completions] for g in groups])
    penalty = overlong_penalty(lengths, spec.max_response_length, cfg.overlong_buffer_length,
                               cfg.overlong_buffer_penalty)
    shaped = rewards + penalty
    return shaped, {"reward/overlong_penalty_mean": penalty.mean().item(),
                    "reward/overlong_penalized_fraction": (penalty < 0).float().mean().item(),
                    "reward/shaped_mean": shaped.mean().item()}


def reward_metrics(rewards: torch.Tensor, groups: list[Group]) -> dict[str, float]:
    """The rewards' spread, and the means of what the reward functions reported per sample
    (`reward/FUNCTION/KEY`, e.g. a judge's unparsable answers)."""
    if not rewards.numel():
        return {"reward/mean": math.nan, "reward/std": 0.0, "reward/max": math.nan}
    out = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
           "reward/max": rewards.max().item()}
    return {**out, **per_sample_means([m for g in groups for m in g.reward_metrics], "reward/")}


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


def engine_idle(seen: Activity, before: Activity, own_tokens: float | None = None) -> dict[str, float]:
    """The rollout engines' idle share between two marks (replicas seen at both), the part of it
    weight updates held them, and their busy seconds: the run's generation device-seconds, or with
    `own_tokens` (a run sharing the engines with others) its share of them by the tokens it generated
    of all the engines generated meanwhile."""
    up, idle, paused, tokens = (sum(seen[r][i] - before[r][i] for r in seen if r in before) for i in range(4))
    if up <= 0:
        return {}
    share = 1.0 if own_tokens is None or tokens <= 0 else min(1.0, own_tokens / tokens)
    return {"engine/idle_fraction": idle / up, "engine/paused_fraction": paused / up,
            "usage/generation_device_s": (up - idle) * share}


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
        metrics = {**produced.metrics, **reward_metrics(rewards, scored),
                   "batch/staleness_mean": sum(ages) / max(1, len(ages)),
                   "batch/staleness_max": float(max(ages, default=0)),
                   "batch/mixed_version_samples": float(sum(g.mixed_samples for g in fresh)),
                   "batch/version_spread_max": float(max((g.version_spread for g in fresh), default=0)),
                   "data/cursor": float(produced.data_cursor),
                   "timing/wait_for_rollouts_s": wait_s,
                   **completion_metrics(fresh, spec.policy.generation.max_new_tokens),
                   **episode_metrics(fresh),
                   **engine_idle(seen, self.state.activity_mark,
                                 produced.metrics.get("usage/generated_tokens", 0.0)
                                 if spec.shares_deployed_base else None)}
        if "usage/generation_device_s" not in metrics:  # no earlier mark (the run's first step): the calls' engine time
            metrics["usage/generation_device_s"] = produced.metrics.get("timing/generate_s", 0.0) - \
                produced.metrics.get("plumbing/generate_s", 0.0)
        self.state.activity_mark = seen

        # 2. Advantages; groups whose samples all scored alike (after reward shaping) carry no signal, unless
        # the estimator has another one (a distillation teacher's).
        shaped, shaping_metrics = shaped_rewards(scored, rewards, spec)
        metrics.update(shaping_metrics)
        estimator = advantage_estimator(spec.grpo.adv_estimator, spec.loss_fn)
        keep = torch.ones(len(scored), dtype=torch.bool)
        if spec.grpo.skip_zero_advantage_groups and scored and estimator.rewards_only:
            keep = ~zero_variance_groups(shaped)
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
        adv_inputs = advantage_inputs(trainable, shaped[keep], estimator.needs_reference_logprobs)
        advantages = estimator(adv_inputs)
        metrics.update(estimator.metrics(adv_inputs))

        # 3. Train on the batch.
        batch = build_batch(trainable, advantages, spec.reference_to_learner)
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
