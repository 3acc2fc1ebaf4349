"""The async GRPO loop of one run (one attempt; `recovery.py` runs attempts until the run ends).

A producer keeps generation ahead of training: it generates step k's groups
as soon as they cannot be more than max_age weight versions old when trained
(`staleness.py`; max_age = `grpo.async_grpo.max_trajectory_age_steps`, 0
when async is off), so with max_age 0 the loop is plain synchronous
on-policy GRPO and with max_age >= 1 generation for step k overlaps training
of step k - 1. The trainer takes one step's groups, drops the stale, errored
and signal-less ones (counted in the ledger), computes group-relative
advantages, trains, and publishes the new weights to the rollout service. A
step left with no trainable group is skipped with a WARNING event; a run that
trains nothing at all fails.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter

import ray
import torch

from rlserve.algorithms.dynamic_sampling import zero_variance_groups
from rlserve.algorithms.registry import advantage_estimator
from rlserve.data.tasks import Example
from rlserve.training.batch import TrainBatch
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2
from services.coordinator import checkpoints
from services.coordinator.context import Context
from services.coordinator.groups import Group, summarize_errors
from services.coordinator.rollouts import BatchTimings, rollout_groups
from services.coordinator.sft import sft_warm_start
from services.coordinator.sync import sync_weights
from services.coordinator.validation import validate

log = logging.getLogger("rlserve.coordinator")
# Reward-error messages shown per step in the DROPPED event; the rest are only counted.
ERROR_MESSAGES_PER_STEP = 3


# --- producer ---------------------------------------------------------------------------


async def produce(ctx: Context) -> None:
    """Generate each step's groups as soon as the staleness bound allows."""
    if ctx.spec.grpo.async_grpo.streaming:
        await produce_streaming(ctx)
        return
    spec = ctx.spec
    while ctx.produced_steps < spec.grpo.max_num_steps:
        step = ctx.produced_steps
        async with ctx.trainer_moved:
            await ctx.trainer_moved.wait_for(lambda: ctx.staleness.may_generate(step - ctx.trainer_step))
        first = ctx.sampler.position
        examples = ctx.sampler.take(spec.grpo.num_prompts_per_step)
        groups, reward_version, timings = await rollout_groups(
            ctx.calls, spec, ctx.run.run_id, ctx.tok, examples, first, step, ctx.run.version, str(ctx.init_model))
        commit(ctx, step, groups, reward_version, timings)


def commit(ctx: Context, step: int, groups: list[Group], reward_version: str, timings: BatchTimings) -> None:
    """Count and queue one step's groups. Synchronous, so a checkpoint sees both or neither."""
    ctx.run.ledger.generate(sum(g.size for g in groups))
    if ctx.reward_version is not None and reward_version != ctx.reward_version:
        ctx.emit(pb.EVENT_KIND_REWARD_SWAP, f"reward service changed: {ctx.reward_version} -> {reward_version}")
    ctx.reward_version = reward_version
    ctx.timings[step] = timings.metrics()
    ctx.engine_activity.update(timings.activity)
    ctx.produced_steps += 1
    ctx.queue.put(groups)
    ctx.run.save()
    ctx.progress()


async def produce_streaming(ctx: Context) -> None:
    """Requests of `prompts_per_request` prompts, at most `max_prompts_in_flight` prompts at once; step
    k + 1's prompts go out as soon as the bound allows, while step k's last groups still generate. Each
    request's groups are scored as soon as its samples finish; a step is committed (counted and
    queued) once all its groups are in, in step order, so checkpoints and the data cursor stay per
    step."""
    spec = ctx.spec
    per_request = spec.grpo.async_grpo.prompts_per_request
    limit = asyncio.Semaphore(max(1, spec.grpo.async_grpo.max_prompts_in_flight // per_request))

    async def one(examples: list[Example], first: int, step: int, offset: int):
        async with limit:
            return await rollout_groups(ctx.calls, spec, ctx.run.run_id, ctx.tok, examples, first + offset, step,
                                        ctx.run.version, str(ctx.init_model), offset=offset)

    async def stream_step(step: int, examples: list[Example], first: int, before: asyncio.Task | None) -> None:
        parts = await asyncio.gather(*(one(examples[i:i + per_request], first, step, i)
                                       for i in range(0, len(examples), per_request)))
        if before is not None:
            await before
        timings = BatchTimings()
        for _, _, t in parts:
            timings.add(t)
        commit(ctx, step, [g for groups, _, _ in parts for g in groups], parts[-1][1], timings)

    running: list[asyncio.Task] = []
    try:
        for step in range(ctx.produced_steps, spec.grpo.max_num_steps):
            await _wait_for_bound(ctx, step, running)
            first = ctx.sampler.position
            examples = ctx.sampler.take(spec.grpo.num_prompts_per_step)
            running.append(asyncio.create_task(stream_step(step, examples, first, running[-1] if running else None)))
        for task in running:
            await task
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def _wait_for_bound(ctx: Context, step: int, running: list[asyncio.Task]) -> None:
    """Wait until step `step` may generate; a failed step in `running` raises at once."""
    async def bound() -> None:
        async with ctx.trainer_moved:
            await ctx.trainer_moved.wait_for(lambda: ctx.staleness.may_generate(step - ctx.trainer_step))

    gate = asyncio.create_task(bound())
    try:
        while not gate.done():
            done, _ = await asyncio.wait([gate, *running], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not gate and task.exception() is not None:
                    raise task.exception()
            running[:] = [t for t in running if not t.done()]
    finally:
        gate.cancel()


# --- trainer ----------------------------------------------------------------------------


def drop(ctx: Context, groups: list[Group], reason: str, detail: str = "") -> int:
    """Count `groups` as dropped and announce it; returns how many trajectories that was."""
    if not groups:
        return 0
    n = sum(g.size for g in groups)
    ctx.run.ledger.drop(reason, n)
    ctx.emit(pb.EVENT_KIND_DROPPED, f"dropped {len(groups)} groups ({n} trajectories): {reason}"
             + (f": {detail}" if detail else ""), {f"dropped/{reason}": float(n)})
    return n


def build_batch(groups: list[Group], advantages: torch.Tensor, with_reference: bool) -> TrainBatch:
    seqs, prompt_lens, advs, gen_lps, ref_lps = [], [], [], [], []
    for g, adv in zip(groups, advantages.tolist()):
        for j, completion in enumerate(g.completions):
            seqs.append(g.prompt_ids + completion)
            prompt_lens.append(len(g.prompt_ids))
            advs.append(adv[j])
            gen_lps.append(g.gen_logprobs[j])
            if with_reference:
                ref_lps.append(g.ref_logprobs[j])
    return TrainBatch.from_sequences(seqs, prompt_lens, advs, gen_lps, ref_lps if with_reference else None)


def reward_metrics(rewards: torch.Tensor) -> dict[str, float]:
    if not rewards.numel():
        return {"reward/mean": math.nan, "reward/std": 0.0, "reward/max": math.nan}
    return {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "reward/max": rewards.max().item()}


def completion_metrics(groups: list[Group], max_new_tokens: int) -> dict[str, float]:
    """Completion lengths: RL batches are long-tailed, and the longest sample sets a synchronous step's pace."""
    lengths = [len(c) for g in groups for c in g.completions]
    if not lengths:
        return {}
    return {"completion/tokens_mean": sum(lengths) / len(lengths), "completion/tokens_max": float(max(lengths)),
            "completion/clipped_fraction": sum(n >= max_new_tokens for n in lengths) / len(lengths)}


def engine_idle(ctx: Context) -> dict[str, float]:
    """The rollout engines' idle share since the previous step (replicas that answered in both), and
    the part of it weight updates held them."""
    seen, before = dict(ctx.engine_activity), ctx.activity_mark
    ctx.activity_mark = seen
    up, idle, paused = (sum(seen[r][i] - before[r][i] for r in seen if r in before) for i in range(3))
    return {"engine/idle_fraction": idle / up, "engine/paused_fraction": paused / up} if up > 0 else {}


async def train_step(ctx: Context, step: int) -> dict[str, float]:
    """One GRPO step: take groups -> filter -> advantages -> train -> sync weights."""
    spec = ctx.spec
    t0 = time.perf_counter()
    version = ctx.run.version

    # 1. This step's groups; the stale ones (older than the bound) and those a reward plug-in
    #    failed on are dropped, never trained.
    fresh, stale = await ctx.queue.take(spec.grpo.num_prompts_per_step, version, ctx.staleness)
    wait_s = time.perf_counter() - t0
    dropped = Counter({"stale": drop(ctx, stale, "stale")})
    errored = [g for g in fresh if g.reward_errors]
    dropped["reward_error"] = drop(ctx, errored, "reward_error", summarize_errors(
        [m for g in errored for m in g.reward_errors], ERROR_MESSAGES_PER_STEP))
    scored = [g for g in fresh if not g.reward_errors]
    rewards = torch.tensor([g.rewards for g in scored], dtype=torch.float32)
    ages = [ctx.staleness.age(version, g.weight_version) for g in fresh]
    metrics = {**reward_metrics(rewards),
               "batch/staleness_mean": sum(ages) / max(1, len(ages)), "batch/staleness_max": float(max(ages, default=0)),
               "batch/mixed_version_samples": float(sum(g.mixed_samples for g in fresh)),
               "batch/version_spread_max": float(max((g.version_spread for g in fresh), default=0)),
               "data/cursor": float(min(g.prompt_index for g in fresh + stale)), "timing/wait_for_rollouts_s": wait_s,
               **completion_metrics(fresh, spec.policy.generation.max_new_tokens), **engine_idle(ctx)}

    # 2. Group-relative advantages; groups whose samples all scored alike carry no signal.
    keep = torch.ones(len(scored), dtype=torch.bool)
    if spec.grpo.skip_zero_advantage_groups and scored:
        keep = ~zero_variance_groups(rewards)
        dropped["zero_advantage"] = drop(ctx, [g for g, k in zip(scored, keep.tolist()) if not k], "zero_advantage")
    trainable = [g for g, k in zip(scored, keep.tolist()) if k]
    metrics["batch/groups_trained"] = float(len(trainable))
    metrics["batch/trajectories_trained"] = float(sum(g.size for g in trainable))
    if not trainable:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(dropped.items()) if n)
        ctx.emit(pb.EVENT_KIND_WARNING, f"step {step + 1} skipped: no trainable group (trajectories dropped: "
                 f"{reasons}); the policy stays at version {version}")
        return metrics
    advantages = advantage_estimator(spec.grpo.adv_estimator)(rewards[keep])

    # 3. Train on the batch, passed to the learner through the object store.
    batch = build_batch(trainable, advantages, spec.loss_fn.reference_policy_kl_penalty > 0)
    t1 = time.perf_counter()
    result = await ctx.calls.train_step(learner_pb2.TrainStepRequest(
        run_id=ctx.run.run_id, loss_name=spec.loss_fn.name, expected_weight_version=version), ray.put(batch))
    train_s = time.perf_counter() - t1
    metrics.update(result.metrics)
    metrics["timing/train_s"] = train_s
    metrics["plumbing/train_s"] = train_s - result.metrics.get("perf/learner_step_seconds", train_s)

    # 4. New weights to the generator.
    metrics.update(await sync_weights(ctx))
    metrics["timing/step_s"] = time.perf_counter() - t0
    return metrics


async def train(ctx: Context) -> None:
    spec, run = ctx.spec, ctx.run
    for step in range(ctx.trainer_step, spec.grpo.max_num_steps):
        metrics = await train_step(ctx, step)
        metrics.update(ctx.timings.pop(step, {}))
        last = step + 1 == spec.grpo.max_num_steps
        if spec.grpo.val_period and ((step + 1) % spec.grpo.val_period == 0 or last):
            metrics.update(await validate(ctx, step + 1))
        run.step = step + 1
        async with ctx.trainer_moved:
            ctx.trainer_step = step + 1
            ctx.trainer_moved.notify_all()
        run.last_metrics = {k: v for k, v in metrics.items() if isinstance(v, float)}
        run.recorder.metrics(step + 1, metrics)
        # Counted as trained only with the STEP event that announces it: a fault before this point
        # (weight sync, validation) leaves them in flight, and the rewind drops them as `recovered`.
        run.ledger.train(int(metrics["batch/trajectories_trained"]))
        ctx.emit(pb.EVENT_KIND_STEP, f"step {step + 1}/{spec.grpo.max_num_steps}", metrics)
        ctx.progress()
        if spec.checkpointing.enabled and ((step + 1) % spec.checkpointing.save_period == 0) and not last:
            await checkpoints.save(ctx, step + 1)
        run.save()


# --- the run ------------------------------------------------------------------------------


async def setup(ctx: Context, resume_reason: str) -> None:
    """Restore the last checkpoint (resuming) or configure the learner (after an SFT warm start);
    publish the policy; validate at the start."""
    run, spec = ctx.run, ctx.spec
    restored = bool(resume_reason) and await checkpoints.restore(ctx, resume_reason)
    if not restored:
        if resume_reason:
            checkpoints.start_over(ctx, resume_reason)
        if spec.sft.enabled:
            ctx.init_model = await sft_warm_start(ctx)
        info = await ctx.calls.configure(learner_pb2.ConfigureRequest(
            run_id=run.run_id, spec_yaml=run.run_dir.joinpath("spec.yaml").read_text(),
            init_model_path=str(ctx.init_model)))
        ctx.emit(pb.EVENT_KIND_INFO, f"learner ready: {info.backend} backend, {info.parallel_layout}, "
                 f"{info.num_parameters / 1e6:.2f}M parameters on {info.device}")
    await sync_weights(ctx)
    if spec.grpo.val_at_start and not restored:
        metrics = await validate(ctx, 0)
        run.recorder.metrics(0, metrics)


async def finish(ctx: Context) -> None:
    """Save the final policy and the plot; a run that trained nothing fails, one with skipped steps warns."""
    run, ledger = ctx.run, ctx.run.ledger
    final = run.run_dir / "final_model"
    await ctx.calls.save_checkpoint(learner_pb2.SaveCheckpointRequest(
        run_id=run.run_id, path=str(checkpoints.step_dir(run.run_dir, run.step) / "learner"), hf_path=str(final)))
    run.final_model_path = str(final)
    if ctx.spec.logger.plot_enabled:
        plot = await asyncio.to_thread(run.recorder.plot)
        run.plot_path = str(plot) if plot else ""
    if not ledger.balanced():
        raise RuntimeError(f"ledger does not balance at the end: {ledger.to_dict()}")
    if ledger.trained == 0:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(ledger.dropped.items()))
        raise RuntimeError(f"the run trained nothing: all {ledger.generated} trajectories were dropped ({reasons}); "
                           f"{final} is the initial policy")
    skipped = [r["step"] for r in run.recorder.read("metrics.jsonl") if r.get("batch/groups_trained") == 0.0]
    if skipped:
        ctx.emit(pb.EVENT_KIND_WARNING, f"{len(skipped)} of {run.step} steps trained nothing (steps "
                 f"{', '.join(map(str, skipped[:20]))}{', ...' if len(skipped) > 20 else ''}); see their WARNING "
                 f"and DROPPED events")
    summary = f"final policy in {final}"
    if "val/reward" in run.last_metrics and ctx.initial_val is not None:
        summary += f"; held-out reward: before {ctx.initial_val:.2f} after {run.last_metrics['val/reward']:.2f}"
    ctx.emit(pb.EVENT_KIND_INFO, summary)


async def watchdog(ctx: Context) -> None:
    """Fail a run that makes no progress, rather than let it hang silently."""
    limit = ctx.settings.watchdog_timeout_s
    while True:
        await asyncio.sleep(min(10.0, limit / 4))
        idle = time.monotonic() - ctx.last_progress
        if idle > limit:
            pending = ctx.calls.oldest_pending()
            waiting = f"waiting on {pending[0]} for {pending[1]:.0f}s; " if pending else ""
            raise RuntimeError(f"watchdog: no progress for {idle:.0f}s (limit {limit:.0f}s) at step "
                               f"{ctx.trainer_step}; {waiting}last event: "
                               f"{ctx.run.events[-1].message if ctx.run.events else '-'}")


async def attempt(ctx: Context, resume_reason: str) -> None:
    """Set up (or restore), run producer and trainer under the watchdog, finish; any task's error ends it."""
    tasks: list[asyncio.Task] = []
    try:
        dog = asyncio.create_task(watchdog(ctx))
        main = asyncio.create_task(_main(ctx, resume_reason, tasks))
        tasks += [dog, main]
        done, _ = await asyncio.wait({dog, main}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _main(ctx: Context, resume_reason: str, tasks: list[asyncio.Task]) -> None:
    await setup(ctx, resume_reason)
    producer = asyncio.create_task(produce(ctx))
    trainer = asyncio.create_task(train(ctx))
    tasks += [producer, trainer]
    done, _ = await asyncio.wait({producer, trainer}, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        if task.exception():
            raise task.exception()
    await trainer
    await finish(ctx)
