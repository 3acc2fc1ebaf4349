"""The Tinker API served by the shared test cluster (the gateway's HTTP listener, /api/v1), driven by the
official `tinker` SDK with keys from the cluster's users file: a LoRA model of a user trains with
forward_backward and optim_step on the learner service, its saved weights sample on the vLLM rollout
replicas (prompt logprobs from the same call), two users train models of different ranks at once, each model
is a run of its user (owned, listed, metered in its usage), another user's ids answer as missing ones, and
bad input is the SDK's user error naming the field, never a 500.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.clients.credentials import Credentials
from rlserve.security.users import add_user
from rlserve.v1 import coordinator_pb2 as pb
from tests.support.tinker_training import train_at_once

pytestmark = pytest.mark.integration

# The cluster's rollout deploys preset:tiny: the Tinker API serves it under this name.
BASE = "rlserve/tiny"


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                                       "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


DATA = [datum([5, 9, 12, 7, 30, 31, 4]), datum([8, 8, 40, 41, 42])]


@pytest.fixture(scope="module")
def keys(test_cluster) -> dict[str, str]:
    return {name: add_user(test_cluster.cluster.users_file, name, admin=False, tinker=True)
            for name in ("tinkann", "tinkbob")}


def _url(test_cluster) -> str:
    return test_cluster.cluster.http_url


def test_two_users_train_and_sample_lora_models_through_the_official_sdk(test_cluster, keys):
    url = _url(test_cluster)
    ann = tinker.ServiceClient(base_url=url, api_key=keys["tinkann"])
    bob = tinker.ServiceClient(base_url=url, api_key=keys["tinkbob"])
    assert BASE in [m.model_name for m in ann.get_server_capabilities().supported_models]
    a = ann.create_lora_training_client(base_model=BASE, rank=4).result()
    b = bob.create_lora_training_client(base_model=BASE, rank=16).result()
    assert (a.get_info().lora_rank, b.get_info().lora_rank) == (4, 16)
    losses = train_at_once({"a": a, "b": b}, DATA, learning_rate=1e-2)  # 5e-2 overshot by step 3
    assert all(len(v) == 3 and v[-1] < v[0] for v in losses.values()), losses
    lps = a.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    # The saved weights sample on the rollout replicas; their prompt logprobs are the learner's.
    sampler = a.save_weights_and_get_sampling_client().result()
    prompt = DATA[0].model_input
    out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, temperature=1.0, seed=3),
                         include_prompt_logprobs=True).result()
    assert len(out.sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in out.sequences)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == prompt.length
    np.testing.assert_allclose(np.asarray(out.prompt_logprobs[1:]), lps[:-1], atol=5e-3)
    base = bob.create_sampling_client(base_model=BASE).result()
    assert base.sample(prompt, 1, types.SamplingParams(max_tokens=2, temperature=0.0)).result().sequences[0].tokens

    # Each model is a run of its user, listed and metered; the other user's ids answer as missing ones.
    with CoordinatorClient(test_cluster.endpoint, credentials=Credentials(keys["tinkann"])) as runs:
        mine = [r for r in runs.list() if r.run_id.startswith("tinkann.tinker-")]
        assert [r.state for r in mine] == [pb.RUN_STATE_RUNNING]
        usage = runs.get(mine[0].run_id).usage
    assert usage.trained_tokens >= 3 * 10 and usage.training_device_seconds > 0, usage
    with httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": keys["tinkbob"]}) as http:
        theirs = http.post("/get_info", json={"model_id": a.model_id})
        missing = http.post("/get_info", json={"model_id": "nobody-000000000000:train:0"})
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json()["detail"].replace(a.model_id, "X") == \
            missing.json()["detail"].replace("nobody-000000000000:train:0", "X")

    # Bad input: the SDK's user errors naming the field; the other user's model is as it was.
    before = b.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
    vocab = 1000
    bad = [([types.Datum(model_input=types.ModelInput.from_ints([1, 2, 10 * vocab]),
                         loss_fn_inputs={"target_tokens": np.array([1, 2, 3])})], "cross_entropy", None,
            "data[0].model_input"),
           ([types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                         loss_fn_inputs={"target_tokens": np.array([1, 2])})], "cross_entropy", None,
            "data[0].loss_fn_inputs.target_tokens"),
           (DATA, "ppo", None, "loss_fn_inputs.logprobs"),
           (DATA, "dro", {"beta": -1.0}, "loss_fn_config.beta")]
    for data, loss, config, field in bad:
        with pytest.raises(tinker.RequestFailedError) as err:
            a.forward_backward(data, loss, config).result()
        assert err.value.category == types.RequestErrorCategory.User and field in str(err.value), err.value
    with pytest.raises(tinker.RequestFailedError, match="lora_config.rank"):
        ann.create_lora_training_client(base_model=BASE, rank=10_000).result()
    with pytest.raises(tinker.RequestFailedError, match="max_tokens"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=0)).result()
    with httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": keys["tinkann"]}) as http:
        assert http.post("/forward_backward", content=b"\xff\x00garbage",
                         headers={"Content-Type": "application/x-protobuf"}).status_code == 400
        assert http.post("/optim_step", content=b"{not json").status_code == 400
        assert http.post("/get_info", json={"model_id": a.model_id},
                         headers={"X-API-Key": "tml-wrong"}).status_code == 401
    assert b.forward(DATA, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(before, abs=1e-5)

    # Ending the sessions ends the models' runs.
    ann.close("success").result()
    bob.close("success").result()
    with CoordinatorClient(test_cluster.endpoint, credentials=Credentials(keys["tinkann"])) as runs:
        mine = [r for r in runs.list() if r.run_id.startswith("tinkann.tinker-")]
    assert mine and all(r.state != pb.RUN_STATE_RUNNING for r in mine)
