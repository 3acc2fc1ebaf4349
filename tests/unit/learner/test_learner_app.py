"""The learner app's Configure over an in-process session table (no Ray): the coordinator's carried
RunSpec reaches the workers as that object, a gRPC caller's spec_yaml is parsed once, a bad one is
refused naming its key."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import yaml

from rlserve.config import load_spec
from rlserve.learner.in_process_group import InProcessWorkerGroup
from rlserve.learner.sessions import SessionTable
from rlserve.rpc import RpcError
from rlserve.v1 import learner_pb2
from services.learner.app import Learner

SPEC = {"policy": {"model_name": "preset:tiny", "dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": 4}},
                   "max_total_sequence_length": 32, "generation": {"max_new_tokens": 8}},
        "cluster": {"device": "cpu"}}


def test_configure_takes_the_carried_spec_or_parses_the_yaml_once(publishing, tmp_path):
    async def main():
        learner = Learner.func_or_class({"paths": {"runs_dir": str(tmp_path)}})
        learner.sessions = table = SessionTable(InProcessWorkerGroup.starter(publishing))
        carried = load_spec(yaml.safe_dump(SPEC))
        info = await learner.Configure(learner_pb2.ConfigureRequest(run_id="a", shared_base=True), carried)
        assert info.backend == "dtensor" and info.weight_version == 0 and info.num_parameters > 0
        host = table.sessions["a"].group.workers.host
        assert table.sessions["a"].spec is carried and host.runs["a"].spec is carried  # never re-parsed

        await learner.Configure(learner_pb2.ConfigureRequest(run_id="b", spec_yaml=yaml.safe_dump(SPEC),
                                                             shared_base=True))
        assert host.runs["b"].spec is table.sessions["b"].spec == carried

        with pytest.raises(RpcError) as err:
            await learner.Configure(learner_pb2.ConfigureRequest(run_id="c", spec_yaml="grpo: {num_prompts_per_stpe: 3}"))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "grpo.num_prompts_per_stpe" in err.value.message
        assert sorted(table.sessions) == ["a", "b"]

    asyncio.run(main())
