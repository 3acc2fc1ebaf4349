"""`algorithm: sft` and `algorithm: dpo` runs against the in-memory services: they train their steps
through the learner with their own loss and lr, count examples in a ledger that balances, save the
final policy, DPO brings the reference service's logprobs for whole pairs, a too-long pair is
dropped with its reason, and a lost learner session heals from the last checkpoint."""

from __future__ import annotations

import asyncio
import json

from rlserve.data.preferences import PreferencePair
from rlserve.loop.inputs import LoopSettings
from rlserve.loop.recovery import run_to_end
from rlserve.runs.ledger import Ledger
from rlserve.runs.record import Run
from rlserve.training.batch import TrainBatch
from rlserve.v1 import coordinator_pb2 as pb
from tests.support.fake_services import FakeServices

SETTINGS = LoopSettings(weight_store="fake", watchdog_timeout_s=60)


class Recording(FakeServices):
    """Keeps every training batch."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.batches: list[TrainBatch] = []

    async def train_step(self, req, batch):
        self.batches.append(batch)
        return await super().train_step(req, batch)


def balanced_as_announced(run: Run) -> bool:
    announced = Ledger(run.ledger.generated, run.ledger.scored).as_announced(run.events)
    return run.ledger.balanced() and announced.to_dict() == run.ledger.to_dict()


def sft_run(make_run, **sft) -> Run:
    run, _ = make_run(algorithm="sft", sft={"max_num_steps": 4, "batch_size": 8, "val_period": 2, "lr": 0.01,
                                            "stop_at_val_reward": None, **sft})
    return run


def test_an_sft_run_trains_its_steps_with_the_sft_loss_and_saves_the_policy(make_run):
    run = sft_run(make_run)
    services = Recording()
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert run.step == 4 and run.version == 4
    requests = [req for req, _ in services.calls.train]
    assert [r.loss_name for r in requests] == ["sft"] * 4 and {r.learning_rate for r in requests} == {0.01}
    assert [b.num_seqs for b in services.batches] == [8] * 4
    assert all(b.loss_mask is not None and b.gen_logprobs is None for b in services.batches)
    assert run.ledger.generated == run.ledger.trained == 32 and balanced_as_announced(run)
    rows = run.recorder.read("metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and "val/reward" in rows[2] and "val/reward" in rows[4]
    assert [r["data/cursor"] for r in rows[1:]] == [0, 8, 16, 24]
    assert (run.run_dir / "final_model" / "config.json").is_file()
    assert services.calls.generate and not services.calls.reference  # validation generates; no reference
    assert any("final policy in" in ev.message for ev in run.events)


def test_an_sft_run_stops_at_the_held_out_reward_it_was_given(make_run):
    run = sft_run(make_run, stop_at_val_reward=0.0, max_num_steps=10)
    asyncio.run(run_to_end(run, FakeServices(), SETTINGS))
    assert run.step == 2 and any("sft.stop_at_val_reward" in ev.message for ev in run.events)


def test_a_lost_learner_session_resumes_an_sft_run_at_its_checkpoint(make_run):
    run = sft_run(make_run)
    services = FakeServices(lose_state_at_version=3)  # in step 4, after the step-2 checkpoint
    asyncio.run(run_to_end(run, services, SETTINGS))
    # Steps 3 (trained, undone) and 4 (taken when the session died) came after the checkpoint.
    assert run.step == 4 and balanced_as_announced(run) and run.ledger.dropped["recovered"] == 16
    assert [r["data/cursor"] for r in run.recorder.read("metrics.jsonl")[1:]] == [0, 8, 16, 24]
    assert [ev for ev in run.events if ev.kind == pb.EVENT_KIND_RECOVERED]


def preference_file(tmp_path, rows: int, long_row: bool = False):
    path = tmp_path / "prefs.jsonl"
    lines = [{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(rows)]
    if long_row:
        lines[0] = {"prompt": "1+" * 40 + "1=", "chosen": "41", "rejected": "40"}
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def dpo_run(make_run, path, **dpo) -> Run:
    run, inputs = make_run(algorithm="dpo", data={"task": "jsonl", "train_path": str(path), "num_val": 4},
                           dpo={"max_num_steps": 3, "batch_size": 4, "lr": 0.001, **dpo})
    assert all(isinstance(p, PreferencePair) for p in inputs.train) and not inputs.val
    return run


def test_a_dpo_run_trains_whole_pairs_against_the_reference(make_run, tmp_path):
    run = dpo_run(make_run, preference_file(tmp_path, 40))
    services = Recording()
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert run.step == 3 and [req.loss_name for req, _ in services.calls.train] == ["dpo"] * 3
    for batch in services.batches:
        assert batch.num_seqs == 8 and batch.ref_logprobs is not None
        # Chosen then rejected, with one prompt each pair.
        assert all(batch.sequence(2 * k)[:int(batch.prompt_lens[2 * k])].tolist()
                   == batch.sequence(2 * k + 1)[:int(batch.prompt_lens[2 * k + 1])].tolist() for k in range(4))
    assert services.calls.reference == 3 and not services.calls.generate  # no rollout for DPO
    assert run.ledger.trained == 12 and balanced_as_announced(run)
    assert (run.run_dir / "final_model" / "config.json").is_file()


def test_a_pair_too_long_to_train_is_dropped_with_its_reason(make_run, tmp_path):
    # 36 training pairs (4 held out), 9 steps of 4: one pass, the long pair met once.
    run = dpo_run(make_run, preference_file(tmp_path, 40, long_row=True), max_num_steps=9)
    services = Recording()
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert run.ledger.dropped == {"too_long": 1} and balanced_as_announced(run)
    assert sum(b.num_seqs for b in services.batches) == 2 * 35


def test_supervised_runs_follow_the_policy_scheduler_and_refuse_the_policy_optimizer_lr(make_run):
    """The section's lr is the base the policy's scheduler shapes (warm-up, cosine decay over the run's
    steps); `policy.optimizer.kwargs.lr`, which would be ignored, is refused naming the key."""
    import pytest

    from rlserve.config import parse_spec

    run, _ = make_run(algorithm="sft", sft={"max_num_steps": 4, "batch_size": 8, "val_period": 4, "lr": 0.01,
                                            "stop_at_val_reward": None},
                      policy={"scheduler": {"warmup_steps": 2, "decay": "cosine", "min_lr_ratio": 0.0}})
    services = Recording()
    asyncio.run(run_to_end(run, services, SETTINGS))
    lrs = [req.learning_rate for req, _ in services.calls.train]
    assert lrs == pytest.approx([0.005, 0.01, 0.01, 0.005])  # warm-up 1/2, 2/2; cosine at 0 and 1/2
    for algorithm in ("sft", "dpo"):
        with pytest.raises(ValueError, match=f"policy.optimizer.kwargs.lr: an algorithm: {algorithm} run trains at "
                                             f"{algorithm}.lr"):
            parse_spec({"algorithm": algorithm, "data": {"task": "jsonl", "train_path": "x.jsonl"},
                        "policy": {"optimizer": {"kwargs": {"lr": 3e-5}}}})
