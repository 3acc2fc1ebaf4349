"""A model with a chat template and several EOS ids (as Llama-3.x-Instruct and Gemma-3 list them)
goes through SubmitRun, the SFT warm start and GRPO in chat format, and its final model keeps the
chat template and generation config."""

from __future__ import annotations

import json
import shutil

import pytest

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.models import resolve_model
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.runs_support import events_until_end, spec

# Written with the character tokenizer's alphabet: "<s>u:47+85=</s>a:" for one user turn.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture(scope="module")
def client(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as c:
        yield c


@pytest.fixture(scope="module")
def chat_model(test_cluster):
    """The served tiny model (same weights, so the rollout accepts it) as a chat model with two EOS ids,
    in the cluster's model directory."""
    path = test_cluster.models_dir / "chat-model"
    shutil.copytree(resolve_model("preset:tiny"), path)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = [2, 3]  # "</s>" ends a turn, "<unk>" stands in for a second end token
        (path / name).write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def test_a_chat_model_with_several_eos_ids_runs(client, chat_model):
    text = spec(policy__model_name=str(chat_model), data__prompt_format="chat", grpo__max_num_steps=2,
                sft={"enabled": True, "max_num_steps": 2, "val_period": 2, "stop_at_val_reward": None})
    run = client.submit(text)
    events_until_end(client, run.run_id)
    run = client.get(run.run_id)
    assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
    assert run.ledger.generated == 2 * 8 * 4 == run.ledger.scored
    final = f"{run.run_dir}/final_model"
    assert open(f"{final}/chat_template.jinja").read() == TEMPLATE
    assert json.load(open(f"{final}/generation_config.json"))["eos_token_id"] == [2, 3]


def test_chat_format_without_a_template_fails_in_preflight(client):
    """The check needs the model's tokenizer, so it runs off the request path, before the run takes the learner."""
    run = client.submit(spec(data__prompt_format="chat"))
    events_until_end(client, run.run_id)
    run = client.get(run.run_id)
    assert run.state == pb.RUN_STATE_FAILED and run.step == 0 and run.ledger.generated == 0
    assert run.error.startswith("preflight: FAILED_PRECONDITION:") and "data.prompt_format" in run.error
