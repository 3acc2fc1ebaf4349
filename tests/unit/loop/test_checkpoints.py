"""The loop's typed checkpoint state: it round-trips, and checkpoints written before it had a type (an RL
run's with its part at the top level, a supervised run's without an initial policy) read back."""

from __future__ import annotations

import json
from collections import Counter

from rlserve.loop.checkpoints import CheckpointState, latest, step_dir
from rlserve.runs.ledger import Ledger


def test_the_state_round_trips_and_its_presence_marks_the_checkpoint_complete(make_run, tmp_path):
    _, inputs = make_run()
    state = CheckpointState("grpo", 4, 4, 16, Ledger(80, 80, 64, Counter({"stale": 16})), "/m", 0.25,
                            {"produced_steps": 4, "reward_version": "v", "buffer": []})
    for step in (2, 4, 6):
        folder = step_dir(tmp_path, step)
        folder.mkdir(parents=True)
        if step < 6:
            state.commit(folder, keep_last=1)
    assert latest(tmp_path) == step_dir(tmp_path, 4)  # step 6 has no coordinator.json; step 2 was removed
    assert not (step_dir(tmp_path, 2) / "coordinator.json").exists()
    read = CheckpointState.from_json((step_dir(tmp_path, 4) / "coordinator.json").read_text(), inputs)
    assert read == state


def test_checkpoints_from_before_the_typed_state_read_back(make_run):
    _, inputs = make_run()
    ledger = {"generated": 32, "scored": 32, "trained": 16, "dropped": {}}
    grpo = CheckpointState.from_json(json.dumps({
        "step": 2, "weight_version": 2, "produced_steps": 3, "data_cursor": 12, "ledger": ledger,
        "reward_version": "abc", "init_model": "/runs/r/sft_model", "initial_val": 0.1, "buffer": []}), inputs)
    assert (grpo.algorithm, grpo.init_model, grpo.data_cursor) == ("grpo", "/runs/r/sft_model", 12)
    assert grpo.algorithm_state == {"produced_steps": 3, "reward_version": "abc", "buffer": []}
    sft = CheckpointState.from_json(json.dumps({
        "algorithm": "sft", "step": 5, "weight_version": 5, "data_cursor": 40, "ledger": ledger,
        "initial_val": None}), inputs)
    assert (sft.algorithm, sft.init_model, sft.algorithm_state) == ("sft", str(inputs.model_path), {})
