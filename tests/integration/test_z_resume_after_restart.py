"""A run resumes from its last checkpoint after the whole cluster was restarted under it
(named to run last: it restarts the shared cluster)."""

from __future__ import annotations

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.cluster.lifecycle import down, up
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.runs_support import events_until_end, spec, wait_for


def test_resume_after_cluster_restart(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as client:
        run = client.submit(spec(grpo__max_num_steps=6, grpo__val_period=3, checkpointing__save_period=2),
                            run_id="itest-resume")
        wait_for(client, run.run_id, pb.EVENT_KIND_CHECKPOINT)
    down(test_cluster.cluster)
    up(test_cluster.cluster)
    with CoordinatorClient(test_cluster.endpoint) as client:
        interrupted = client.get(run.run_id)  # the new coordinator knows it from its run directory
        assert interrupted.state == pb.RUN_STATE_FAILED and "--resume" in interrupted.error
        resumed = client.submit("", run_id=run.run_id, resume=True)
        events = events_until_end(client, resumed.run_id)
        final = client.get(run.run_id)
    assert final.state == pb.RUN_STATE_SUCCEEDED, final.error
    assert final.step == 6
    assert any(ev.kind == pb.EVENT_KIND_INFO and ev.message.startswith("resumed from step_") for ev in events)
    first_step = min(ev.step for ev in events if ev.kind == pb.EVENT_KIND_STEP)
    assert first_step > 1, "the resumed run must not start over"
    assert final.ledger.in_flight == 0
    assert final.ledger.generated == final.ledger.trained + sum(final.ledger.dropped.values())
