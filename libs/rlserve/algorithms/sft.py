"""Supervised fine-tuning on the data's reference answers: an `algorithm: sft` run, and the warm start
of an RL run (`sft.enabled`).

SFT trains on the assistant's tokens of each example (`PromptTokenizer.sft_tokens`: the answer, and a
chat row's earlier assistant turns), through `TrainBatch.loss_mask`, at `sft.lr`, one update per step;
it validates the held-out reward every `sft.val_period` steps and stops early at
`sft.stop_at_val_reward`.

The warm start: a random tiny model almost never samples a correct answer, so GRPO would see no reward
signal. A short supervised phase on the reference answers gives it a foothold; its output becomes the
RL run's initial policy and its KL reference. It trains every weight, in a LoRA run too: the run's
adapters then train on the SFT model, which is their base (on the learner and on the rollout) and the
reference policy, as for full-parameter runs.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

from rlserve.algorithms.supervised import Supervised, SupervisedBatch, truncated
from rlserve.config import RunSpec
from rlserve.data.dataset import PromptSampler, build_splits
from rlserve.data.prompts import PromptTokenizer
from rlserve.data.tasks import Example
from rlserve.loop.algorithm import AttemptView
from rlserve.loop.learner import configure_learner
from rlserve.loop.validation import evaluate
from rlserve.training.batch import TrainBatch
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2


def sft_batch(tok: PromptTokenizer, examples: list[Example], max_len: int) -> SupervisedBatch:
    seqs, starts, masks = [], [], []
    for ex in examples:
        cut = truncated(*tok.sft_tokens(ex), max_len)
        if cut is not None:
            seqs.append(cut[0])
            starts.append(cut[1])
            masks.append(cut[2])
    batch = TrainBatch.from_sequences(seqs, starts, loss_mask=masks) if seqs else None
    return SupervisedBatch(batch, len(seqs), len(examples) - len(seqs))


class Sft(Supervised):
    unit = "examples"
    section = "sft"
    loss = "sft"

    @classmethod
    def data(cls, spec: RunSpec) -> tuple[list, list]:
        splits = build_splits(spec.data)
        return splits.train, splits.val[: spec.grpo.max_val_samples]

    async def build(self, items: list[Any], max_len: int) -> SupervisedBatch:
        return await asyncio.to_thread(sft_batch, self.attempt.inputs.tok, items, max_len)

    def validates_at_start(self) -> bool:
        return bool(self.attempt.inputs.val)

    def validation_due(self, steps_done: int) -> bool:
        return bool(self.attempt.inputs.val) and (steps_done % self.cfg.val_period == 0
                                                  or steps_done == self.max_steps)

    def stop_reason(self, metrics: dict[str, float]) -> str:
        goal, reward = self.cfg.stop_at_val_reward, metrics.get("val/reward")
        if goal is None or reward is None or reward < goal:
            return ""
        return f"held-out reward {reward:.3f} reached sft.stop_at_val_reward ({goal})"


def _full_parameter(spec: RunSpec) -> RunSpec:
    """The spec the warm start trains with: every weight, in a LoRA run too."""
    if not spec.policy.lora.enabled:
        return spec
    full = spec.model_copy(deep=True)
    full.policy.lora.enabled = False
    return full


async def sft_warm_start(attempt: AttemptView) -> Path:
    """Train on the reference answers, validating every `sft.val_period` steps; returns the policy's HF folder."""
    inputs, run, services = attempt.inputs, attempt.run, attempt.services
    cfg = inputs.spec.sft
    out = run.run_dir / "sft_model"
    await configure_learner(services, inputs, inputs.model_path, _full_parameter(inputs.spec))
    attempt.state.version = 0
    sampler = PromptSampler(list(inputs.train), inputs.spec.data.seed + 1)
    reward = 0.0
    spent: Counter[str] = Counter()  # usage/* of the steps since the last event (`rlserve.runs.usage`)
    for i in range(cfg.max_num_steps):
        built = await asyncio.to_thread(sft_batch, inputs.tok, sampler.take(cfg.batch_size),
                                        inputs.spec.policy.max_total_sequence_length)
        if built.batch is None:
            raise ValueError(f"SFT warm start: none of {cfg.batch_size} examples fits "
                             f"policy.max_total_sequence_length")
        result = await attempt.train(built.batch, "sft", cfg.lr)
        spent.update({k: v for k, v in result.metrics.items() if k.startswith("usage/")})
        attempt.progress()
        if (i + 1) % cfg.val_period and i + 1 < cfg.max_num_steps:
            continue
        await attempt.sync.publish()
        val, _ = await evaluate(services, inputs, attempt.state.version)
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
