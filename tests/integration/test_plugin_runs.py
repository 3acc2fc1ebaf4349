"""A user's package adds a loss and an advantage estimator that a real run trains with: the shared
cluster enables the example package (tests/plugins; `plugins` in cluster.yaml), the coordinator's spec
reader accepts their names, the coordinator builds the estimator, the learner's workers the loss, and
the run's STEP events carry the metrics each reports. A name the cluster did not enable is refused."""

from __future__ import annotations

import grpc
import pytest

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.runs_support import assert_records_agree, events_until_end, metric_events, spec


@pytest.fixture(scope="module")
def client(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as c:
        yield c


def test_a_run_trains_with_a_plugin_loss_and_estimator(client):
    run = client.submit(spec(grpo__max_num_steps=2, grpo__val_period=0, loss_fn={"name": "counted_grpo"},
                             grpo__adv_estimator={"name": "centered"}))
    events = events_until_end(client, run.run_id)
    run = client.get(run.run_id)
    assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
    assert_records_agree(run, events)
    steps = metric_events(events)
    assert len(steps) == 2
    for m in steps:
        assert m["example_plugin/loss_micro_batches"] >= 1  # the learner's workers trained with the plug-in loss
        assert m["example_plugin/estimator_groups"] == m["batch/groups_trained"]  # the coordinator's estimator


def test_a_name_the_cluster_did_not_enable_is_refused_with_the_valid_ones(client):
    with pytest.raises(grpc.RpcError) as err:
        client.submit(spec(loss_fn={"name": "not_enabled"}))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "loss_fn.name: unknown loss 'not_enabled'; valid: grpo, cispo, counted_grpo" in err.value.details()
