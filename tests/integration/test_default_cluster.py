"""The embedded default cluster (what `deploy/serve up` with no file and `make demo` bring up), as it ships
but for its ports and with the internal services exposed to the admin token: a run trains on it, every
version after the session's first reaches the rollout's transformers engine by the shared-memory handoff
(`rlserve.weights.handoff`) with nothing loaded from the weight store, and what the engine serves at the
end is bit for bit the run's final model."""

from __future__ import annotations

import pytest
import yaml

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.cluster.config import default_cluster_file
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import rollout_pb2, rollout_pb2_grpc
from rlserve.weights.digest import differences, folder_digests
from tests.integration.conftest import running_cluster
from tests.integration.runs_support import assert_consistent, events_until_end, metric_events, spec


@pytest.fixture(scope="module")
def default_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("default")
    data = yaml.safe_load(default_cluster_file().read_text())
    data.update(ray_port=6500, grpc_port=9120, http_port=9121, expose_internal=True)
    (root / "default.yaml").write_text(yaml.safe_dump(data))
    with running_cluster(root / "default.yaml", root) as cluster:
        yield cluster


def test_a_run_on_the_default_cluster_hands_weights_over_in_shared_memory(default_cluster):
    with CoordinatorClient(default_cluster.endpoint) as client:
        run = client.submit(spec(grpo__max_num_steps=4, grpo__val_period=4, grpo__async_grpo={"enabled": "auto"}))
        events = events_until_end(client, run.run_id, timeout_s=600)
        final = client.get(run.run_id)
    assert final.state == pb.RUN_STATE_SUCCEEDED, final.error
    # Generation and training share the cores here: `auto` runs sync (issue 27's measured rule).
    assert any(ev.message.startswith("async_grpo.enabled auto: sync") for ev in events), \
        [ev.message for ev in events][:10]
    steps = metric_events(events)
    assert len(steps) == 4
    assert_consistent(steps)  # transformers (CPU, fp32), dense, full weights, one turn
    later = steps[1:]
    assert all(m["weight_sync/direct_mib"] > 0 for m in later), later
    assert all(m["weight_sync/store_fetch_mib"] == 0 for m in later), later
    with default_cluster.channel(default_cluster.token(admin=True)) as channel:
        served = rollout_pb2_grpc.RolloutStub(channel).GetInfo(rollout_pb2.GetInfoRequest(weight_digests=True),
                                                               timeout=120)
    assert served.engine == "transformers" and served.weight_transfer == "handoff"
    expected = folder_digests(default_cluster.runs_dir / run.run_id / "final_model")
    assert served.weight_sha256 and not differences(expected, dict(served.weight_sha256)), \
        differences(expected, dict(served.weight_sha256))[:10]
