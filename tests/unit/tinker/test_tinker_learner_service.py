"""Checkpoints through the learner service's RPCs, the cluster's path (`ServiceTrainer` -> the learner app's
Configure, SaveCheckpoint, LoadCheckpoint over the endpoint's session table): a state saved by `save_state`
starts a new model (`create_training_client_from_state`, with and without the optimizer) and loads onto a
model that trained on (`load_state`), each at the saved numbers; a sampler's weights are refused naming
their kind. The in-process `TableTrainer` hands the adapter folder to the table directly, so only this path
met the learner's check of `init_model_path`."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from rlserve.config import parse_spec
from rlserve.rpc import RpcError
from rlserve.tinker.backends import ServiceTrainer
from rlserve.v1 import learner_pb2
from services.learner.app import Learner
from tests.unit.tinker.conftest import BASE
from tests.unit.tinker.test_sdk import DATA


class AppLearner:
    """`LearnerCalls` over the learner app's methods, in process (the coordinator's Serve handles on a
    cluster)."""

    def __init__(self, app):
        self.app = app

    async def configure(self, req, spec):
        return await self.app.Configure(req, spec)

    async def forward(self, req):
        return await self.app.Forward(req)

    async def optim_step(self, req):
        return await self.app.OptimStep(req)

    async def save_checkpoint(self, req):
        return await self.app.SaveCheckpoint(req)

    async def load_checkpoint(self, req):
        return await self.app.LoadCheckpoint(req)

    async def release_learner(self, run_id):
        await self.app.ReleaseSession(learner_pb2.ReleaseSessionRequest(run_id=run_id))


@pytest.fixture
def learner(endpoint, monkeypatch):
    app = Learner.func_or_class({"paths": {"runs_dir": str(endpoint.service.runs_dir)}})
    app.sessions = endpoint.service.trainer.table
    monkeypatch.setattr(endpoint.service, "trainer", ServiceTrainer(AppLearner(app)))
    return app


def test_a_saved_state_starts_and_loads_models_through_the_learner_service(endpoint, learner):
    alice = tinker.ServiceClient(base_url=endpoint.url, api_key=endpoint.keys["alice"])
    trainer = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    adam = types.AdamParams(learning_rate=2e-2)
    trainer.forward_backward(DATA, "cross_entropy").result()
    trainer.optim_step(adam).result()
    path = trainer.save_state("step-1").result().path
    at_save = trainer.forward(DATA, "cross_entropy").result().metrics["loss:sum"]

    weights_only = alice.create_training_client_from_state(path).result()
    assert weights_only.get_info().lora_rank == 4
    assert weights_only.forward(DATA, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_save, abs=1e-5)
    resumed = alice.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.forward(DATA, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_save, abs=1e-5)

    trainer.forward_backward(DATA, "cross_entropy").result()
    trainer.optim_step(adam).result()
    assert trainer.forward(DATA, "cross_entropy").result().metrics["loss:sum"] != pytest.approx(at_save, abs=1e-5)
    trainer.load_state(path).result()
    assert trainer.forward(DATA, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_save, abs=1e-5)

    sampler_path = trainer.save_weights_for_sampler("step-1").result().path
    with pytest.raises(tinker.RequestFailedError, match="holds sampler weights"):
        alice.create_training_client_from_state(sampler_path).result()
    alice.close("success").result()


def test_an_init_model_path_that_is_neither_model_nor_adapter_is_refused_naming_both(endpoint, learner):
    empty = endpoint.service.runs_dir / "nothing-here"
    empty.mkdir(parents=True, exist_ok=True)
    spec = parse_spec({"name": "t", "policy": {"model_name": "preset:tiny-chat",
                                               "dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": 4}}}})
    req = learner_pb2.ConfigureRequest(run_id="x", init_model_path=str(empty), shared_base=True)
    with pytest.raises(RpcError, match="no config.json.*no adapter_config.json"):
        endpoint.run(learner.Configure(req, spec))
