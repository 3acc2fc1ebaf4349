"""Property-based: malformed specs and requests thrown at every public RPC get a gRPC status other
than INTERNAL or UNKNOWN, and the coordinator keeps answering (ListRuns, a good GetRun) afterwards.

Specs are mutations of a valid one (values replaced by huge or non-finite numbers, long or odd
strings, lists, nested mappings) plus a `policy.max_total_sequence_length` beyond the rollout's
model length, so that a spec that happens to be valid is still refused (FAILED_PRECONDITION) after
every other check and no run starts. Examples are few: they share the cluster with every other test.
"""

from __future__ import annotations

import copy
import time

import grpc
import pytest
import yaml
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.config import SpecError, load_spec
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.runs_support import BASE

BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
# Protobuf strings are UTF-8: no lone surrogates.
TEXT = st.characters(blacklist_categories=("Cs",))

values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**80, max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(TEXT, max_size=40)
    | st.sampled_from(["/etc/passwd", "../../x", "preset:nope", "subprocess:Popen", "jsonl", "*" * 3000]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(TEXT, max_size=8), inner, max_size=3),
    max_leaves=8)
PATHS = ["name", "policy.model_name", "policy.generation.temperature", "policy.generation.top_p",
         "policy.generation.max_new_tokens", "policy.generation.stop_strings", "policy.train_micro_batch_size",
         "grpo.max_num_steps", "grpo.num_prompts_per_step", "grpo.num_generations_per_prompt", "grpo.seed",
         "data.task", "data.task_args", "data.num_train", "data.train_path", "data.val_path", "reward.functions",
         "reward.endpoint", "loss_fn.ratio_clip_max", "policy.megatron_cfg", "cluster.num_workers", "sft",
         "checkpointing.keep_last", "unknown_section"]


def _set(data: dict, dotted: str, value) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = value


@st.composite
def mutated_specs(draw) -> str:
    data = copy.deepcopy(BASE)
    for dotted in draw(st.lists(st.sampled_from(PATHS), min_size=1, max_size=3, unique=True)):
        _set(data, dotted, draw(values))
    if isinstance(data.get("policy"), dict):
        data["policy"]["max_total_sequence_length"] = 100_000
    return yaml.safe_dump(data)


@pytest.fixture(scope="module")
def client(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as c:
        yield c


def _code(fn) -> grpc.StatusCode:
    """The call's status; a call refused for the caller's rate (fuzzing is faster than `limits.rate`) is
    made again once the bucket has refilled, so that every example reaches the coordinator."""
    for _ in range(400):
        try:
            out = fn()
            if hasattr(out, "__next__"):
                list(out)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.rate" in (err.details() or ""):
                time.sleep(0.05)
                continue
            return err.code()
        return grpc.StatusCode.OK
    raise AssertionError("the caller stayed over limits.rate for 20 s")


def _answers(client: CoordinatorClient) -> None:
    assert _code(client.list) == grpc.StatusCode.OK
    assert _code(lambda: client.get("no-such-run")) == grpc.StatusCode.NOT_FOUND


@FUZZ
@given(text=mutated_specs(), run_id=st.sampled_from(["", "fuzz-run"]))
def test_submit_run_with_malformed_specs(client, text, run_id):
    code = _code(lambda: client.submit(text, run_id=run_id))
    assert code not in BAD and code != grpc.StatusCode.OK, (code, text[:500])


def _valid(text: str) -> bool:
    try:
        load_spec(text)
    except SpecError:
        return False
    return True


@FUZZ
@given(text=st.text(TEXT, max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
       run_id=st.text(TEXT, max_size=150), resume=st.booleans())
def test_submit_run_with_arbitrary_text(client, text, run_id, resume):
    assume(resume or not _valid(text))  # a valid spec (the empty one is) would start a real run
    code = _code(lambda: client.submit(text, run_id=run_id, resume=resume))
    assert code not in BAD and code != grpc.StatusCode.OK, (code, text[:200], run_id[:80])


@FUZZ
@given(run_id=st.text(TEXT, max_size=200), seq=st.integers(min_value=0, max_value=2**64 - 1))
def test_run_ids_on_get_cancel_and_watch(client, run_id, seq):
    for fn in (lambda: client.get(run_id), lambda: client.cancel(run_id),
               lambda: client.stub.WatchRun(pb.WatchRunRequest(run_id=run_id, from_sequence=seq),
                                            metadata=client.metadata, timeout=30)):
        assert _code(fn) not in BAD


@FUZZ
@given(method=st.sampled_from(["SubmitRun", "GetRun", "ListRuns", "CancelRun", "WatchRun"]),
       payload=st.binary(max_size=200))
def test_arbitrary_bytes_on_every_public_rpc(client, method, payload):
    if method == "SubmitRun":  # bytes that decode to a valid spec (b"" is the default one) would start a run
        try:
            request = pb.SubmitRunRequest.FromString(payload)
            assume(request.resume or not _valid(request.spec_yaml))
        except DecodeError:
            pass
    path = f"/rlserve.v1.Coordinator/{method}"
    rpc = (client.channel.unary_stream(path) if method == "WatchRun" else client.channel.unary_unary(path))
    code = _code(lambda: rpc(payload, metadata=client.metadata, timeout=30))
    assert code not in BAD, (method, payload)


def test_the_coordinator_answers_after_the_fuzzing(client):
    _answers(client)
    started = [r.run_id for r in client.list() if r.state in (pb.RUN_STATE_QUEUED, pb.RUN_STATE_RUNNING)]
    assert not started, f"the fuzzing must not start runs (they would hold the cluster): {started}"
