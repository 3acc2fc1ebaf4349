"""Models as sessions of users, through the official SDK: two users train models of different ranks at once
on the one shared base; bad input gets the SDK's user errors naming the field and leaves the other user's
model as it was; another user's ids answer as missing ones; save, load and resume (with the optimizer, to
the same numbers); a sampler whose adapter the engine dropped loads it again."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.tinker_training import train_at_once
from tests.unit.tinker.conftest import BASE
from tests.unit.tinker.test_sdk import DATA


def client(endpoint, user: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=endpoint.url, api_key=endpoint.keys[user])


def test_two_users_train_models_of_different_ranks_at_once_and_bad_input_disturbs_neither(endpoint):
    alice, bob = client(endpoint, "alice"), client(endpoint, "bob")
    a = alice.create_lora_training_client(base_model=BASE, rank=2).result()
    b = bob.create_lora_training_client(base_model=BASE, rank=16).result()
    losses = train_at_once({"a": a, "b": b}, DATA, learning_rate=5e-3, timeout_s=120)
    assert all(len(v) == 3 and v[-1] < v[0] for v in losses.values()), losses
    assert (a.get_info().lora_rank, b.get_info().lora_rank) == (2, 16)

    before = b.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
    bad = [
        ([types.Datum(model_input=types.ModelInput.from_ints([1, 2, 9999]),
                      loss_fn_inputs={"target_tokens": np.array([1, 2, 3])})], "cross_entropy", None,
         "data[0].model_input"),
        ([types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                      loss_fn_inputs={"target_tokens": np.array([1, 2])})], "cross_entropy", None,
         "data[0].loss_fn_inputs.target_tokens"),
        (DATA, "ppo", None, "loss_fn_inputs.logprobs"),
        (DATA, "cross_entropy", {"beta": 1.0}, "loss_fn_config.beta"),
        (DATA, "dro", {"beta": -1.0}, "loss_fn_config.beta"),
    ]
    for data, loss, config, field in bad:
        victim = alice.create_lora_training_client(base_model=BASE, rank=2).result()
        with pytest.raises(tinker.RequestFailedError) as err:
            victim.forward_backward(data, loss, config).result()
        assert err.value.category == types.RequestErrorCategory.User and field in str(err.value)
        endpoint.run(endpoint.service.unload("alice", victim.model_id))
    with pytest.raises(tinker.RequestFailedError, match="loss_fn"):
        a.forward(DATA, "kl_magic").result()  # type: ignore[arg-type]
    assert b.forward(DATA, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(before, abs=1e-6)

    # Malformed bodies and another user's model: 4xx in the SDK's shape, never a 500.
    headers = {"X-API-Key": endpoint.keys["alice"]}
    with httpx.Client(base_url=endpoint.url, headers=headers) as http:
        assert http.post("/api/v1/forward_backward", content=b"\xff\x00garbage",
                         headers={"Content-Type": "application/x-protobuf"}).status_code == 400
        assert http.post("/api/v1/optim_step", content=b"{not json").status_code == 400
        gone = http.post("/api/v1/get_info", json={"model_id": b.model_id})
        missing = http.post("/api/v1/get_info", json={"model_id": "nobody:train:0"})
        assert gone.status_code == missing.status_code == 404
        assert gone.json()["detail"].replace(b.model_id, "X") == missing.json()["detail"].replace("nobody:train:0", "X")
        assert http.post("/api/v1/get_info", json={"model_id": b.model_id},
                         headers={"X-API-Key": "tml-wrong"}).status_code == 401
    alice.close("success").result()
    bob.close("success").result()


def test_save_load_and_resume_with_the_optimizer_gives_the_same_numbers(endpoint):
    alice = client(endpoint, "alice")
    trainer = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    adam = types.AdamParams(learning_rate=2e-2)
    trainer.forward_backward(DATA, "cross_entropy").result()
    trainer.optim_step(adam).result()
    path = trainer.save_state("step-1", ttl_seconds=3600).result().path
    trainer.forward_backward(DATA, "cross_entropy").result()
    trainer.optim_step(adam).result()
    straight = trainer.forward(DATA, "cross_entropy").result().metrics["loss:sum"]

    resumed = alice.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().lora_rank == 4
    resumed.forward_backward(DATA, "cross_entropy").result()
    resumed.optim_step(adam).result()
    assert resumed.forward(DATA, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(straight, abs=1e-5)
    weights_only = alice.create_training_client_from_state(path).result()
    at_save = weights_only.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
    assert at_save != pytest.approx(straight, abs=1e-5)
    rest = tinker.RestClient(base_url=endpoint.url, api_key=endpoint.keys["alice"])
    ckpt = rest.list_checkpoints(trainer.model_id).result().checkpoints[0]
    assert ckpt.expires_at is not None and ckpt.tinker_path == path
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):  # bob: as a missing path
        client(endpoint, "bob").create_training_client_from_state(path).result()
    alice.close("success").result()


def test_a_sampler_whose_adapter_was_dropped_loads_it_again(endpoint):
    alice = client(endpoint, "alice")
    trainer = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    params = types.SamplingParams(max_tokens=3, temperature=0.0)
    prompt = types.ModelInput.from_ints([5, 9, 12])
    samplers = []
    for _ in range(3):  # the engine holds two adapters: the third drops the first
        trainer.forward_backward(DATA, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        samplers.append(trainer.save_weights_and_get_sampling_client().result())
    first = [s.sample(prompt, 1, params).result().sequences[0].tokens for s in samplers]
    reloads = endpoint.sampler.reloads
    again = samplers[0].sample(prompt, 1, params).result().sequences[0].tokens
    assert again == first[0] and endpoint.sampler.reloads > reloads
    base = alice.create_sampling_client(base_model=BASE).result()
    assert base.sample(prompt, 2, params).result().sequences[0].tokens
    alice.close("success").result()
