"""Every built-in loss of the SDK (tinker.types.LossFnType), value and gradient against its formula as the
SDK's documentation writes it (https://tinker-docs.thinkingmachines.ai/tinker/losses: sums over tokens;
`p` the learner's logprob of the target, `q` the sampler's, `A` the advantage):

- value: through the official SDK on the endpoint, `loss:sum` against the formula evaluated here on the
  logprobs the call returns;
- gradient: d loss / d p of `rlserve.training.primitives` (autograd, what the learner backpropagates)
  against the formula's derivative written here.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from rlserve.training.primitives import LOSSES, loss_config
from tests.unit.tinker.conftest import BASE

N = 6
rng = np.random.default_rng(0)
Q = np.log(rng.uniform(0.05, 0.5, N)).astype(np.float32)  # the sampler's logprobs
ADV = rng.normal(size=N).astype(np.float32)
MASK = np.array([0, 1, 1, 1, 1, 0], dtype=np.float32)


def clip(x, lo, hi):
    return np.minimum(np.maximum(x, lo), hi)


# The documented formulas (numpy): value of the loss from p.
FORMULAS = {
    "cross_entropy": lambda p, c: -(p * MASK).sum(),
    "importance_sampling": lambda p, c: -(np.exp(p - Q) * ADV).sum(),
    "ppo": lambda p, c: -np.minimum(np.exp(p - Q) * ADV, clip(np.exp(p - Q), 0.9, 1.1) * ADV).sum(),
    "cispo": lambda p, c: -(clip(np.exp(p - Q), 0.8, 1.2) * p * ADV).sum(),
    "dro": lambda p, c: -(p * ADV - 0.5 * 0.1 * (p - Q) ** 2).sum(),
    "gspo": lambda p, c: -(np.minimum(_s(p) * ADV, clip(_s(p), 1 - 3e-4, 1 + 4e-4) * ADV) * MASK).sum(),
}
CONFIGS = {"ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, "dro": {"beta": 0.1}}


def _s(p):
    return np.exp(((p - Q) * MASK).sum() / MASK.sum())


def inputs(loss: str) -> dict:
    out = {"target_tokens": np.arange(10, 10 + N, dtype=np.int64)}
    if loss == "cross_entropy":
        out["weights"] = MASK
    else:
        out["logprobs"], out["advantages"] = Q, ADV
    if loss == "gspo":
        out["sequence_ratio_mask"] = MASK
    return out


@pytest.fixture(scope="module")
def trainer(endpoint):
    client = tinker.ServiceClient(base_url=endpoint.url, api_key=endpoint.keys["bob"])
    yield client.create_lora_training_client(base_model=BASE, rank=4).result()
    client.close("success").result()


@pytest.mark.parametrize("loss", sorted(FORMULAS))
def test_each_losss_value_through_the_sdk_is_its_documented_formula(trainer, loss):
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(20, 20 + N))), loss_fn_inputs=inputs(loss))
    out = trainer.forward([datum], loss, CONFIGS.get(loss)).result()
    p = out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)
    assert out.metrics["loss:sum"] == pytest.approx(FORMULAS[loss](p, CONFIGS.get(loss)), rel=1e-4, abs=1e-4)


# d loss / d p of each formula (the sg() of CISPO and GSPO-token written out).
def _grads(p: np.ndarray) -> dict[str, np.ndarray]:
    r = np.exp(p - Q)
    s = _s(p)
    ppo_active = np.where(ADV >= 0, r <= 1.1, r >= 0.9)
    gspo_active = np.where(ADV >= 0, s <= 1 + 4e-4, s >= 1 - 3e-4)
    return {
        "cross_entropy": -MASK,
        "importance_sampling": -r * ADV,
        "ppo": -np.where(ppo_active, r * ADV, 0.0),
        "cispo": -clip(r, 0.8, 1.2) * ADV,
        "dro": -(ADV - 0.1 * (p - Q)),
        "gspo": -np.where(gspo_active, s * ADV, 0.0) * MASK,
        "stable_reinforce": -np.minimum(r, 2.0) * ADV + 0.5 * (1 - np.exp(-(p - Q))),
    }


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_each_losss_gradient_is_its_formulas_derivative(loss):
    p = torch.tensor(Q + rng.normal(scale=0.3, size=N).astype(np.float32), requires_grad=True)
    x = {k: torch.tensor(v, dtype=torch.float32) for k, v in inputs(loss).items() if k != "target_tokens"}
    config = dict(CONFIGS.get(loss, {}))
    if loss == "stable_reinforce":
        x = {"logprobs": torch.tensor(Q), "advantages": torch.tensor(ADV)}
        config = {"kl_coeff": 0.5}
    LOSSES[loss].fn(p, x, loss_config(LOSSES[loss], config)).backward()
    expected = _grads(p.detach().numpy().astype(np.float64))[loss]
    np.testing.assert_allclose(p.grad.numpy(), expected, rtol=1e-4, atol=1e-5)
