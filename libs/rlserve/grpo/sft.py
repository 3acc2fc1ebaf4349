"""The SFT warm start: teach the generated model the task's answer format before GRPO.

A random tiny model almost never samples a correct answer, so GRPO would see
no reward signal. A short supervised phase on the reference answers (stopped
once held-out reward reaches `sft.stop_at_val_reward`) gives it a foothold;
its output becomes GRPO's initial policy and the KL reference. It trains
every weight, in a LoRA run too: the run's adapters then train on the SFT
model, which is their base (on the learner and on the rollout) and the
reference policy, as for full-parameter runs.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from rlserve.data.dataset import PromptSampler
from rlserve.grpo.services import RunServices
from rlserve.grpo.state import RunInputs
from rlserve.grpo.sync import WeightSync
from rlserve.grpo.validation import evaluate
from rlserve.runs.record import Run
from rlserve.supervised.batches import sft_batch
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2


async def sft_warm_start(inputs: RunInputs, run: Run, services: RunServices, sync: WeightSync,
                         progress: Callable[[], None]) -> Path:
    """Train on the reference answers, validating every `sft.val_period` steps; returns the policy's HF folder."""
    cfg = inputs.spec.sft
    out = run.run_dir / "sft_model"
    await services.configure(learner_pb2.ConfigureRequest(
        run_id=run.run_id, spec_yaml=inputs.sft_spec_yaml(), init_model_path=str(inputs.model_path)))
    sampler = PromptSampler(list(inputs.train), inputs.spec.data.seed + 1)
    reward = 0.0
    version = 0
    spent: Counter[str] = Counter()  # usage/* of the steps since the last event (`rlserve.runs.usage`)
    for i in range(cfg.max_num_steps):
        examples = sampler.take(cfg.batch_size)
        # The assistant's tokens, as an algorithm: sft run trains them (rlserve.supervised.batches).
        built = await asyncio.to_thread(sft_batch, inputs.tok, examples, inputs.spec.policy.max_total_sequence_length)
        if built.batch is None:
            raise ValueError(f"SFT warm start: none of {len(examples)} examples fits policy.max_total_sequence_length")
        result = await services.train_step(learner_pb2.TrainStepRequest(
            run_id=run.run_id, loss_name="sft", learning_rate=cfg.lr, expected_weight_version=version), built.batch)
        version = result.weight_version
        spent.update({k: v for k, v in result.metrics.items() if k.startswith("usage/")})
        progress()
        if (i + 1) % cfg.val_period and i + 1 < cfg.max_num_steps:
            continue
        await sync.publish()
        val, _ = await evaluate(services, inputs, run.version)
        reward = val["val/reward"]
        run.emit(pb.EVENT_KIND_VALIDATION, f"SFT step {i + 1}: loss {result.metrics.get('loss/total', 0):.3f}, "
                 f"held-out reward {reward:.3f}", {"sft/loss": result.metrics.get("loss/total", 0.0),
                                                   "sft/val_reward": reward, "sft/step": float(i + 1),
                                                   **spent})
        spent.clear()
        if cfg.stop_at_val_reward is not None and reward >= cfg.stop_at_val_reward:
            break
    await services.save_checkpoint(learner_pb2.SaveCheckpointRequest(
        run_id=run.run_id, path=str(run.run_dir / "sft_checkpoint"), hf_path=str(out)))
    run.emit(pb.EVENT_KIND_INFO, f"SFT warm start done after {i + 1} steps (held-out reward {reward:.3f}); "
             f"GRPO starts from {out}")
    return out
