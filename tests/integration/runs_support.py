"""Helpers for coordinator tests: small specs, waiting on a run's events (always with a deadline, so a
hung stream fails the test), and checks of a finished run against its own records."""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import yaml

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.v1 import coordinator_pb2 as pb

TERMINAL = {pb.RUN_STATE_SUCCEEDED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED}

BASE = {
    "name": "itest",
    "policy": {"max_total_sequence_length": 32, "generation": {"max_new_tokens": 5}},
    "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4, "max_num_steps": 3, "val_period": 2,
             "max_val_samples": 16},
    # Partial credit gives a random model's groups some reward variance, so steps really train.
    "reward": {"functions": [{"name": "exact_match", "args": {"partial_credit": True}}]},
    "checkpointing": {"save_period": 2},
    "data": {"num_train": 2000, "num_val": 16},
}


def spec(**overrides) -> str:
    data = copy.deepcopy(BASE)
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return yaml.safe_dump(data)


def events_until_end(client: CoordinatorClient, run_id: str, timeout_s: float = 300,
                     from_sequence: int = 0) -> list[pb.RunEvent]:
    return list(_watched(client, run_id, from_sequence, timeout_s))


def wait_for(client: CoordinatorClient, run_id: str, kind: int, timeout_s: float = 120,
             where=lambda ev: True) -> pb.RunEvent:
    for ev in _watched(client, run_id, 0, timeout_s):
        if ev.kind == kind and where(ev):
            return ev
    raise AssertionError(f"run {run_id} ended without a {pb.EventKind.Name(kind)} event")


def _watched(client: CoordinatorClient, run_id: str, from_sequence: int, timeout_s: float
             ) -> Iterator[pb.RunEvent]:
    """The run's events; a stream out of time fails with what tells a stalled run from a stalled stream:
    the last event the stream gave, the run as GetRun answers, and the newest events in its events.jsonl."""
    last = None
    try:
        for ev in client.watch(run_id, from_sequence, timeout_s=timeout_s):
            last = ev
            yield ev
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
        run = client.get(run_id)
        on_disk = (Path(run.run_dir) / "events.jsonl").read_text().splitlines()[-5:]
        raise AssertionError(
            f"run {run_id}: no end within {timeout_s:g}s; the stream's last event: "
            f"{(last.sequence, last.message[:120]) if last else None}; GetRun: {pb.RunState.Name(run.state)} at step "
            f"{run.step}, updated {time.time() - run.updated_unix:.0f}s ago; events.jsonl ends with:\n"
            + "\n".join(on_disk)) from err


def metric_events(events: list[pb.RunEvent]) -> list[dict[str, float]]:
    return [dict(ev.metrics) for ev in events if ev.kind == pb.EVENT_KIND_STEP]


# The consistency gate (tests/engines/test_consistency.py says why these bounds): the run's median
# token_mult_prob_error and mean |delta logprob|, and its worst token's |delta logprob|, over the tokens of
# the newest weights (age 0; an async run's older tokens carry the policy's own change too).
CONSISTENCY_GATE = {"token_mult_prob_error": 1.00002, "logprob_abs_diff_mean": 2e-5, "logprob_abs_diff_max": 1e-4}


def assert_consistent(steps: list[dict[str, float]]) -> dict[str, float]:
    """The run's STEP metrics against `CONSISTENCY_GATE`; returns what it measured."""
    import statistics

    fresh = [m for m in steps if "mismatch/age_0/token_mult_prob_error" in m]
    assert fresh, "no step trained tokens of the newest weights"
    got = {"token_mult_prob_error": statistics.median(m["mismatch/age_0/token_mult_prob_error"] for m in fresh),
           "logprob_abs_diff_mean": statistics.median(m["mismatch/age_0/logprob_abs_diff_mean"] for m in fresh),
           "logprob_abs_diff_max": max(m["mismatch/age_0/logprob_abs_diff_max"] for m in fresh)}
    print("consistency:", {k: f"{v:.3g}" for k, v in got.items()})  # the gate's measurements (pytest -s)
    assert all(got[k] < bound for k, bound in CONSISTENCY_GATE.items()), (got, CONSISTENCY_GATE)
    return got


def metric_rows(run: pb.Run) -> list[dict]:
    return [json.loads(line) for line in (Path(run.run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_records_agree(run: pb.Run, events: list[pb.RunEvent]) -> None:
    """A finished run's ledger against what it announced and recorded, from independent sources:
    nothing in flight; each drop reason equals the sum of its DROPPED (and RECOVERED) events; trained
    equals both the STEP events' trajectories (plus RECOVERED rewinds) and, over metrics.jsonl (each
    step once), groups trained x group size; event sequence numbers are 0, 1, 2, ..."""
    ledger, group_size = run.ledger, _group_size(run)
    assert [ev.sequence for ev in events] == list(range(len(events))), "sequence numbers have gaps or repeats"
    assert ledger.in_flight == 0, ledger
    announced = Counter()
    for ev in events:
        if ev.kind in (pb.EVENT_KIND_DROPPED, pb.EVENT_KIND_RECOVERED):
            announced.update({k.removeprefix("dropped/"): v for k, v in ev.metrics.items() if k.startswith("dropped/")})
    assert {k: v for k, v in announced.items() if v} == {k: float(v) for k, v in ledger.dropped.items() if v}
    trained_events = sum(ev.metrics["batch/trajectories_trained"] for ev in events if ev.kind == pb.EVENT_KIND_STEP)
    trained_events += sum(ev.metrics.get("trained", 0.0) for ev in events if ev.kind == pb.EVENT_KIND_RECOVERED)
    rows = [r for r in metric_rows(run) if r["step"] >= 1]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, run.step + 1)), f"metrics.jsonl steps {steps}"
    assert ledger.trained == trained_events == sum(r["batch/groups_trained"] * group_size for r in rows)


def _group_size(run: pb.Run) -> int:
    spec_data = yaml.safe_load((Path(run.run_dir) / "spec.yaml").read_text())
    return spec_data["grpo"]["num_generations_per_prompt"]


def kill_learner_worker() -> int:
    """SIGKILL the learner's worker process (what an OOM kill or a crash of the rank does)."""
    workers = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith(
        "ray::LearnerWorker")]
    assert len(workers) == 1, f"expected one learner worker, found {[p.info['cmdline'] for p in workers]}"
    os.kill(workers[0].pid, signal.SIGKILL)
    return workers[0].pid
