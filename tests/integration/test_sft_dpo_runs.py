"""`algorithm: sft` on a chat JSONL file and `algorithm: dpo` on a preference JSONL file, end to end on the
shared cluster: each finishes, its loss moves as it should (SFT's falls; DPO's starts at log 2, where the
policy is its reference, and falls as the preference accuracy rises), and `rlserve export` hands out the
final policy."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.models import resolve_model
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.runs_support import events_until_end, metric_rows

# The character tokenizer's alphabet: "<s>u:47+85=</s>a:" for one user turn (as in test_chat_runs.py).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture(scope="module")
def client(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as c:
        yield c


@pytest.fixture(scope="module")
def chat_model(test_cluster):
    """The served tiny model with a chat template (same weights, so the rollout accepts it)."""
    path = test_cluster.models_dir / "sft-chat-model"
    shutil.copytree(resolve_model("preset:tiny"), path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def sums(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(f"{a}+{b}=", str(a + b)) for a, b in ((rng.randint(10, 49), rng.randint(10, 49)) for _ in range(n))]


def finished(client: CoordinatorClient, data: dict) -> tuple[pb.Run, list[dict]]:
    run = client.submit(yaml.safe_dump(data))
    events_until_end(client, run.run_id, timeout_s=600)
    run = client.get(run.run_id)
    assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
    assert run.ledger.in_flight == 0 and run.ledger.trained > 0
    return run, [r for r in metric_rows(run) if r["step"] >= 1]


def exported(test_cluster, run: pb.Run) -> Path:
    cli = str(Path(sys.executable).with_name("rlserve"))
    out = subprocess.run([cli, "export", run.run_id, "--runs-dir", str(test_cluster.runs_dir)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


BASE = {"policy": {"max_total_sequence_length": 32, "generation": {"max_new_tokens": 5}},
        "logger": {"tensorboard_enabled": False}, "checkpointing": {"save_period": 5}}


def test_an_sft_run_on_chat_jsonl_learns_the_assistant_turns(client, test_cluster, chat_model):
    path = test_cluster.data_dir / "sft_chat.jsonl"
    with path.open("w") as f:
        for (p0, a0), (p1, a1) in zip(sums(400, 1), sums(400, 2)):
            f.write(json.dumps({"messages": [{"role": "user", "content": p0}, {"role": "assistant", "content": a0},
                                             {"role": "user", "content": p1}, {"role": "assistant", "content": a1}]})
                    + "\n")
    run, rows = finished(client, {**BASE, "name": "itest-sft", "algorithm": "sft", "policy": {
        **BASE["policy"], "model_name": str(chat_model), "max_total_sequence_length": 48},
        "data": {"task": "jsonl", "train_path": str(path), "prompt_format": "chat", "num_val": 16},
        "sft": {"max_num_steps": 20, "batch_size": 32, "lr": 3e-3, "val_period": 10, "stop_at_val_reward": None}})
    assert run.step == 20 and run.ledger.trained == 20 * 32
    losses = [r["loss/total"] for r in rows]
    assert losses[-1] < 0.8 * losses[0], losses
    assert "val/reward" in rows[-1]
    final = exported(test_cluster, run)
    assert (final / "model.safetensors").is_file() and (final / "chat_template.jinja").read_text() == TEMPLATE


def test_a_dpo_run_on_preference_jsonl_prefers_the_chosen(client, test_cluster):
    path = test_cluster.data_dir / "prefs.jsonl"
    with path.open("w") as f:
        for prompt, answer in sums(400, 3):
            f.write(json.dumps({"prompt": prompt, "chosen": answer, "rejected": str(int(answer) + 7)}) + "\n")
    run, rows = finished(client, {**BASE, "name": "itest-dpo", "algorithm": "dpo",
                                  "data": {"task": "jsonl", "train_path": str(path), "num_val": 16},
                                  "dpo": {"max_num_steps": 15, "batch_size": 16, "lr": 1e-3,
                                          "reference_policy_kl_penalty": 0.1}})
    assert run.step == 15 and run.ledger.trained == 15 * 16
    losses = [r["loss/total"] for r in rows]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3)  # the policy is its reference at the first step
    assert losses[-1] < losses[0] and rows[-1]["dpo/accuracy"] > 0.5, (losses, rows[-1])
    assert (exported(test_cluster, run) / "model.safetensors").is_file()
