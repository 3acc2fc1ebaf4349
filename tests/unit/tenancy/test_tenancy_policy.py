"""The `tenancy` section and the policy that answers every limit question: each limit just under and just
over, its RESOURCE_EXHAUSTED naming its key, and names that never collide between a user and the cluster."""

from __future__ import annotations

import pickle

import grpc
import pytest
import yaml
from pydantic import ValidationError

from rlserve.config import load_spec
from rlserve.security.principal import SYSTEM, Principal, Role
from rlserve.tenancy.policy import (
    MAX_TRAINING_RUNS,
    CallerLimits,
    ClusterLimits,
    OverLimit,
    TenancyPolicy,
    UserQuota,
    samples_of,
)

ALICE, BOB, ROOT = Principal("alice", Role.USER), Principal("bob", Role.USER), Principal("root", Role.ADMIN)
SPEC = load_spec(yaml.safe_dump({"grpo": {"max_num_steps": 2, "num_prompts_per_step": 4,
                                          "num_generations_per_prompt": 2}}))


def _answer(fn) -> str:
    try:
        fn()
    except OverLimit as err:
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        return err.message
    return "ok"


def test_a_limit_of_a_user_and_one_of_the_cluster_never_share_a_name():
    parts = {"callers": CallerLimits, "default_user": UserQuota, "cluster": ClusterLimits}
    names = [name for model in parts.values() for name in model.model_fields]
    assert len(names) == len(set(names)), names
    # The two names that meant two things each are no key of the section.
    assert not {"max_concurrent_runs", "max_queued_runs"} & set(names)
    assert set(TenancyPolicy.model_fields) == {*parts, "users"}


def test_the_defaults():
    policy = TenancyPolicy()
    assert policy.callers.model_dump() == {
        "max_streams": 16, "max_calls_in_flight": 32, "calls_per_s": 50.0, "call_burst": 100, "max_request_kb": 512,
        "spec_reading_share": 0.1, "spec_reading_burst_s": 2.0, "spec_reading_max_wait_s": 30.0}
    assert policy.default_user.model_dump() == {"max_unfinished_runs": 8, "max_waiting_runs": 8,
                                                "max_samples_per_run": 100_000_000, "max_priority": 1.0}
    assert policy.cluster.model_dump() == {"max_training_runs": 4, "queue_capacity": 64}
    assert policy.users == {}


def test_caller_limits_each_just_under_and_just_over():
    limits = TenancyPolicy.model_validate({"callers": {"max_streams": 2, "max_calls_in_flight": 3,
                                                       "calls_per_s": 5, "call_burst": 7, "max_request_kb": 1}})
    callers = limits.callers
    assert _answer(lambda: callers.check_request_size(1024)) == "ok"
    assert _answer(lambda: callers.check_request_size(1025)) == (
        "the request is 1 KiB; this endpoint takes at most 1 KiB (tenancy.callers.max_request_kb)")
    assert _answer(lambda: callers.check_call(True, streams=1, in_flight=3, tokens=1)) == "ok"
    assert _answer(lambda: callers.check_call(True, streams=2, in_flight=0, tokens=1)) == (
        "2 streams open; at most 2 at once (tenancy.callers.max_streams)")
    assert _answer(lambda: callers.check_call(False, streams=2, in_flight=2, tokens=1)) == "ok"
    assert _answer(lambda: callers.check_call(False, streams=0, in_flight=3, tokens=1)) == (
        "3 calls in flight; at most 3 at once (tenancy.callers.max_calls_in_flight)")
    assert _answer(lambda: callers.check_call(False, streams=0, in_flight=0, tokens=0.99)) == (
        "more than 5 calls per second (tenancy.callers.calls_per_s, bursts of tenancy.callers.call_burst 7); "
        "slow down")
    assert "tenancy.callers.spec_reading_share sets the share" in callers.spec_waited_too_long().message


def test_user_entries_override_the_default_key_by_key_and_admins_are_not_limited():
    policy = TenancyPolicy.model_validate({"default_user": {"max_waiting_runs": 3},
                                           "users": {"alice": {"max_unfinished_runs": 1},
                                                     "root": {"max_waiting_runs": 2}}})
    alice = policy.limits_of(ALICE)
    assert (alice.values.max_unfinished_runs, alice.values.max_waiting_runs) == (1, 3)
    assert alice.key("max_unfinished_runs") == "tenancy.users.alice.max_unfinished_runs"
    assert alice.key("max_waiting_runs") == "tenancy.default_user.max_waiting_runs"
    assert policy.limits_of(BOB).values.max_waiting_runs == 3 and policy.limits_of(BOB).values.max_unfinished_runs == 8
    assert policy.limits_of(SYSTEM) is None and policy.limits_of(Principal("admin", Role.ADMIN)) is None
    assert policy.limits_of(ROOT).values.max_waiting_runs == 2
    with pytest.raises(ValidationError, match="not user names"):
        TenancyPolicy.model_validate({"users": {"Alice!": {}}})


def test_user_quotas_each_just_under_and_just_over():
    size, _ = samples_of(SPEC)
    assert size == 2 * 4 * 2
    policy = TenancyPolicy.model_validate({"default_user": {"max_unfinished_runs": 2, "max_waiting_runs": 1},
                                           "users": {"alice": {"max_samples_per_run": size}}})
    assert _answer(lambda: policy.check_submit(BOB, SPEC, unfinished=1, waiting=0)) == "ok"
    assert _answer(lambda: policy.check_submit(BOB, SPEC, unfinished=2, waiting=0)) == (
        "quota max_unfinished_runs (tenancy.default_user.max_unfinished_runs) is 2: 2 of your runs are queued or "
        "running; submit when one has finished")
    assert _answer(lambda: policy.check_submit(BOB, SPEC, unfinished=1, waiting=1)) == (
        "quota max_waiting_runs (tenancy.default_user.max_waiting_runs) is 1: 1 of your runs are waiting to start; "
        "submit when one has started")
    assert _answer(lambda: policy.check_submit(ALICE, SPEC, 0, 0)) == "ok"
    bigger = load_spec(yaml.safe_dump({"grpo": {"max_num_steps": 3, "num_prompts_per_step": 4,
                                                "num_generations_per_prompt": 2}}))
    assert _answer(lambda: policy.check_submit(ALICE, bigger, 0, 0)) == (
        f"quota max_samples_per_run (tenancy.users.alice.max_samples_per_run) is {size}: spec_yaml: "
        f"grpo.max_num_steps x grpo.num_prompts_per_step x grpo.num_generations_per_prompt = 3 x 4 x 2 = 24")
    assert _answer(lambda: policy.check_submit(ROOT, bigger, 100, 100)) == "ok"  # an admin without an entry


def test_priority_just_under_and_just_over_the_quota():
    """The per-run limit of the fair share: the weight a run takes there (its priority)."""
    policy = TenancyPolicy.model_validate({"users": {"carol": {"max_priority": 2.5}}})
    carol = Principal("carol", Role.USER)
    spec = SPEC.model_copy(update={"priority": 2.5})
    assert _answer(lambda: policy.check_submit(carol, spec, unfinished=0, waiting=0)) == "ok"
    over = SPEC.model_copy(update={"priority": 2.6})
    assert _answer(lambda: policy.check_submit(carol, over, unfinished=0, waiting=0)) == (
        "quota max_priority (tenancy.users.carol.max_priority) is 2.5: spec_yaml: priority is 2.6")
    # By default every run takes one share: more needs the operator's say, less is anyone's choice.
    assert "(tenancy.default_user.max_priority) is 1:" in _answer(lambda: policy.check_submit(ALICE, spec, 0, 0))
    assert _answer(lambda: policy.check_submit(ALICE, SPEC.model_copy(update={"priority": 0.5}), 0, 0)) == "ok"
    assert _answer(lambda: policy.check_submit(ROOT, over, 0, 0)) == "ok"


def test_the_cluster_limits_just_under_and_just_over():
    policy = TenancyPolicy.model_validate({"cluster": {"max_training_runs": 2, "queue_capacity": 3}})
    assert policy.may_train_beside(1) and not policy.may_train_beside(2)
    assert _answer(lambda: policy.check_queue(2)) == "ok"
    assert _answer(lambda: policy.check_queue(3)) == (
        "3 runs are queued already, the most this cluster holds (tenancy.cluster.queue_capacity); submit when "
        "some have started")
    with pytest.raises(ValidationError, match="max_training_runs"):
        TenancyPolicy.model_validate({"cluster": {"max_training_runs": MAX_TRAINING_RUNS + 1}})
    with pytest.raises(ValidationError, match="max_training_runs"):
        TenancyPolicy.model_validate({"cluster": {"max_training_runs": 0}})


def test_over_limit_keeps_its_type_and_code_across_pickling():
    """Ray pickles what a handle call raises: the gateway and the client still see RESOURCE_EXHAUSTED."""
    err = pickle.loads(pickle.dumps(OverLimit("tenancy.cluster.queue_capacity")))
    assert isinstance(err, OverLimit) and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.message == "tenancy.cluster.queue_capacity"
