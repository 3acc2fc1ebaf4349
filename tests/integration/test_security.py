"""The public endpoint as an attacker on the same host would try it, on the real cluster: tokens on
every public RPC, internal services unreachable by default and admin-only when exposed, TLS, no code
or file named by a request, bounded specs, meaningful status codes, confined resume."""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from ray import serve

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.clients.credentials import Credentials
from rlserve.security.certs import self_signed
from rlserve.v1 import (
    common_pb2,
    coordinator_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
    reference_pb2,
    reference_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.runs_support import events_until_end, spec
from tests.support.dist import free_port

PUBLIC = {
    "SubmitRun": pb.SubmitRunRequest(spec_yaml="[1, 2"),
    "GetRun": pb.GetRunRequest(run_id="no-such-run"),
    "ListRuns": pb.ListRunsRequest(),
    "CancelRun": pb.CancelRunRequest(run_id="no-such-run"),
    "WatchRun": pb.WatchRunRequest(run_id="no-such-run"),
}
# What a valid user token gets for the requests above.
ANSWER = {"SubmitRun": grpc.StatusCode.INVALID_ARGUMENT, "GetRun": grpc.StatusCode.NOT_FOUND,
          "ListRuns": grpc.StatusCode.OK, "CancelRun": grpc.StatusCode.NOT_FOUND, "WatchRun": grpc.StatusCode.NOT_FOUND}
_ANSI = re.compile(r"\x1b\[")


def call(channel: grpc.Channel, name: str, request, token: str | None) -> tuple[grpc.StatusCode, str]:
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    md = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        out = getattr(stub, name)(request, metadata=md, timeout=60)
        if name == "WatchRun":
            list(out)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details() or ""


def status(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    assert not _ANSI.search(err.value.details() or "") and "Traceback" not in (err.value.details() or "")
    return err.value


@pytest.fixture(scope="module")
def plain(test_cluster):
    ch = test_cluster.channel()
    yield ch
    ch.close()


@pytest.mark.parametrize("name", list(PUBLIC))
def test_each_public_rpc_needs_a_valid_token(test_cluster, plain, name):
    request = PUBLIC[name]
    valid = test_cluster.token()
    for token in (None, "x" * 43, valid[:-1] + ("B" if valid.endswith("A") else "A")):
        code, details = call(plain, name, request, token)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (token, details)
    for token in (test_cluster.token(), test_cluster.token(admin=True)):
        assert call(plain, name, request, token)[0] == ANSWER[name]


def test_up_made_private_token_files_that_deploy_serve_token_names(test_cluster):
    user, admin = test_cluster.cluster.token_files
    assert stat.S_IMODE(user.stat().st_mode) == stat.S_IMODE(admin.stat().st_mode) == 0o600
    serve_cli = str(Path(__file__).resolve().parents[2] / "deploy" / "serve")
    for extra, want in (([], user), (["--admin"], admin)):
        out = subprocess.run([serve_cli, "token", str(test_cluster.cluster_file), *extra], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip() == str(want), out.stderr


def test_internal_services_are_admin_only_when_exposed(test_cluster, plain):
    user = (("authorization", f"Bearer {test_cluster.token()}"),)
    admin = (("authorization", f"Bearer {test_cluster.token(admin=True)}"),)
    internal = [
        lambda md: rollout_pb2_grpc.RolloutStub(plain).GetInfo(rollout_pb2.GetInfoRequest(), metadata=md),
        lambda md: reward_pb2_grpc.RewardStub(plain).Score(reward_pb2.ScoreRequest(), metadata=md),
        lambda md: reference_pb2_grpc.ReferenceStub(plain).LogProbs(reference_pb2.LogProbsRequest(), metadata=md),
        lambda md: learner_pb2_grpc.LearnerStub(plain).TrainStep(learner_pb2.TrainStepRequest(), metadata=md),
    ]
    for rpc in internal:
        err = status(lambda: rpc(user))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "admin token" in err.details()
        assert status(lambda: rpc(())).code() == grpc.StatusCode.UNAUTHENTICATED
    assert internal[0](admin).engine == "vllm"


@pytest.fixture(scope="module")
def default_tls_gateway(test_cluster, tmp_path_factory):
    """A second gateway in the same cluster with the cluster file's defaults (internal services not
    exposed) and TLS on, with a certificate made here; removed afterwards."""
    from rlserve.cluster.lifecycle import connect
    from services.gateway.app import build

    connect(test_cluster.cluster)  # a test with a cluster of its own may have attached this process elsewhere
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    files = test_cluster.cluster.token_files
    port = free_port()
    serve.run(build({"host": "127.0.0.1", "port": port, "auth": {"token_file": str(files[0]),
                                                                  "admin_token_file": str(files[1])},
                     "tls": {"cert_file": str(cert), "key_file": str(key)},
                     "deployment": {"num_replicas": 1, "num_cpus": 0.01, "num_gpus": 0, "max_surge_percent": 0}}),
              name="gateway-tls", route_prefix=None)
    try:
        yield f"127.0.0.1:{port}", cert
    finally:
        serve.delete("gateway-tls")


def test_tls_round_trip_and_internal_rpcs_unreachable_by_default(test_cluster, default_tls_gateway, tmp_path):
    endpoint, cert = default_tls_gateway
    secure = Credentials(test_cluster.token(admin=True), cert).channel(endpoint)
    admin = (("authorization", f"Bearer {test_cluster.token(admin=True)}"),)
    assert call(secure, "ListRuns", pb.ListRunsRequest(), test_cluster.token())[0] == grpc.StatusCode.OK
    err = status(lambda: rollout_pb2_grpc.RolloutStub(secure).GetInfo(rollout_pb2.GetInfoRequest(), metadata=admin))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED, "internal RPCs are not served unless the cluster opts in"
    with grpc.insecure_channel(endpoint) as clear:
        assert call(clear, "ListRuns", pb.ListRunsRequest(), test_cluster.token())[0] == grpc.StatusCode.UNAVAILABLE
    token_file = tmp_path / "token"
    token_file.write_text(test_cluster.token() + "\n")
    token_file.chmod(0o600)
    cli = str(Path(sys.executable).with_name("rlserve"))
    out = subprocess.run([cli, "runs", "list", "--endpoint", endpoint, "--ca-file", str(cert), "--token-file",
                          str(token_file)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_no_code_named_by_a_request_runs(test_cluster, channel, tmp_path):
    marker = tmp_path / "marker"
    popen = {"name": "x", "import_path": "subprocess:Popen", "args": {"args": f"touch {marker}", "shell": True}}
    with CoordinatorClient(test_cluster.endpoint) as client:
        err = status(lambda: client.submit(spec(reward__functions=[popen])))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "subprocess:Popen" in err.details() and "reward.allowed_plugins" in err.details()
    err = status(lambda: reward_pb2_grpc.RewardStub(channel).Score(reward_pb2.ScoreRequest(
        items=[reward_pb2.ScoreItem(completion="1")], functions=[reward_pb2.RewardFunctionSpec(
            name="x", import_path="subprocess:Popen", args_json=json.dumps(popen["args"]))])))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "subprocess:Popen" in err.details()
    time.sleep(1)
    assert not marker.exists()
    allowed = reward_pb2_grpc.RewardStub(channel).Score(reward_pb2.ScoreRequest(
        items=[reward_pb2.ScoreItem(completion="12345")], functions=[reward_pb2.RewardFunctionSpec(
            name="short", import_path="rlserve.rewards.builtins:LengthPenalty",
            args_json=json.dumps({"max_chars": 2, "per_char": 0.1}))]))
    assert allowed.results[0].status == reward_pb2.SCORE_STATUS_OK
    assert allowed.results[0].score == pytest.approx(-0.3)


def test_path_traversal_is_refused_in_every_path_field(test_cluster, channel):
    denied = grpc.StatusCode.PERMISSION_DENIED
    outside = ["/etc", "../../etc", f"{test_cluster.models_dir}/../../x"]
    (test_cluster.data_dir / "t.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with CoordinatorClient(test_cluster.endpoint) as client:
        for value in outside:
            assert status(lambda: client.submit(spec(policy__model_name=value))).code() == denied
            jsonl = spec(data={"task": "jsonl", "train_path": value + "/t.jsonl"})
            assert status(lambda: client.submit(jsonl)).code() == denied
            jsonl = spec(data={"task": "jsonl", "train_path": str(test_cluster.data_dir / "t.jsonl"),
                               "val_path": value + "/v.jsonl"})
            assert status(lambda: client.submit(jsonl)).code() == denied
        for run_id in ("../escape", "/tmp/escape", ".cluster", "a/b", "x" * 200):
            for resume in (False, True):
                err = status(lambda: client.submit(spec(), run_id=run_id, resume=resume))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("run_id:")
    learner = learner_pb2_grpc.LearnerStub(channel)
    rollout = rollout_pb2_grpc.RolloutStub(channel)
    reference = reference_pb2_grpc.ReferenceStub(channel)
    for value in outside:
        for field, rpc in (
            ("init_model_path", lambda: learner.Configure(learner_pb2.ConfigureRequest(
                run_id="r", spec_yaml=spec(), init_model_path=value))),
            ("path", lambda: learner.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(run_id="r", path=value))),
            ("hf_path", lambda: learner.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(
                run_id="r", path="r/c", hf_path=value))),
            ("path", lambda: learner.LoadCheckpoint(learner_pb2.LoadCheckpointRequest(run_id="r", path=value))),
            ("safetensors_path", lambda: rollout.UpdateWeights(rollout_pb2.UpdateWeightsRequest(
                version=1, safetensors_path=value))),
            ("model_path", lambda: reference.LogProbs(reference_pb2.LogProbsRequest(model_path=value, sequences=[
                reference_pb2.ScoredSequence(token_ids=[5, 6, 7], prompt_length=1)]))),
        ):
            err = status(rpc)
            assert err.code() == denied and err.details().startswith(field + ":"), err.details()
    assert not Path("/tmp/escape").exists()


@pytest.mark.parametrize("text", [
    spec(grpo__max_num_steps=2**70),
    spec(data__num_train=10**9),
    spec(policy__generation={"temperature": float("inf"), "max_new_tokens": 5}),
    "# padding\n" * 40_000,
])
def test_oversized_specs_are_invalid_and_the_coordinator_keeps_answering(test_cluster, text):
    with CoordinatorClient(test_cluster.endpoint) as client:
        err = status(lambda: client.submit(text))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("spec_yaml")
        assert len(err.details()) <= 1000
        client.list()


def test_a_request_over_the_gateways_size_limit_never_reaches_the_coordinator(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as client:
        err = status(lambda: client.submit(yaml.safe_dump({"name": "n" * (10 * 2**20)})))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenancy.callers.max_request_kb" in err.details()
        client.list()


def test_engine_validation_errors_are_invalid_argument_and_never_retried(test_cluster, channel):
    rollout = rollout_pb2_grpc.RolloutStub(channel)
    prompt = rollout_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[8, 11, 41]))
    for sampling, field in ((common_pb2.SamplingParams(temperature=3.0, max_new_tokens=4), "sampling: temperature"),
                            (common_pb2.SamplingParams(max_new_tokens=4, stop_strings=[""]), "sampling: stop"),
                            (common_pb2.SamplingParams(temperature=float("nan"), max_new_tokens=4),
                             "sampling.temperature")):
        err = status(lambda: rollout.Generate(rollout_pb2.GenerateRequest(prompts=[prompt], sampling=sampling)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field), err.details()
    # The same refusal inside a run (a temperature above vLLM's range of [0, 2]) fails it at once, no retry.
    with CoordinatorClient(test_cluster.endpoint) as client:
        run = client.submit(spec(policy__generation={"max_new_tokens": 5, "temperature": 2.5},
                                 grpo__val_at_start=False, checkpointing__enabled=False))
        events = events_until_end(client, run.run_id)
        final = client.get(run.run_id)
    assert final.state == pb.RUN_STATE_FAILED and "INVALID_ARGUMENT" in final.error
    assert not [ev for ev in events if ev.kind == pb.EVENT_KIND_RETRY]
    assert not _ANSI.search(final.error)


def test_unknown_rpcs_and_undecodable_requests(test_cluster, plain):
    md = (("authorization", f"Bearer {test_cluster.token()}"),)
    err = status(lambda: plain.unary_unary("/rlserve.v1.Coordinator/DropEverything")(b"", metadata=md))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    err = status(lambda: plain.unary_unary("/rlserve.v1.Coordinator/SubmitRun")(b"\x0a\xff\xff\xff", metadata=md))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "SubmitRunRequest" in err.details()


def test_resume_is_confined_to_runs_that_may_continue(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as client:
        one_step = spec(grpo__max_num_steps=1, grpo__val_period=0, checkpointing__enabled=False,
                        reward__functions=[{"name": "exact_match", "args": {"partial_credit": True}}, {
                            "name": "short", "import_path": "rlserve.rewards.builtins:LengthPenalty",
                            "weight": 0.1}])
        run = client.submit(one_step, run_id="itest-extend")
        events_until_end(client, run.run_id)
        assert client.get(run.run_id).state == pb.RUN_STATE_SUCCEEDED, "an allow-listed plug-in runs"
        for again in ("", one_step):
            err = status(lambda: client.submit(again, run_id=run.run_id, resume=True))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "grpo.max_num_steps" in err.details()
        other = one_step.replace("max_num_steps: 1", "max_num_steps: 2").replace("val_period: 0", "val_period: 1")
        err = status(lambda: client.submit(other, run_id=run.run_id, resume=True))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "only grpo.max_num_steps" in err.details()
        longer = one_step.replace("max_num_steps: 1", "max_num_steps: 2")
        resumed = client.submit(longer, run_id=run.run_id, resume=True)
        events_until_end(client, resumed.run_id)
        final = client.get(run.run_id)
    assert final.state == pb.RUN_STATE_SUCCEEDED and final.step == 2 and final.max_steps == 2
