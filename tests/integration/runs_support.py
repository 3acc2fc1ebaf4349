"""Helpers for coordinator tests: small specs, and waiting on a run's events."""

from __future__ import annotations

import copy
import time

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


def events_until_end(client: CoordinatorClient, run_id: str, timeout_s: float = 300) -> list[pb.RunEvent]:
    deadline = time.time() + timeout_s
    events = []
    for ev in client.watch(run_id):
        events.append(ev)
        assert time.time() < deadline, f"run {run_id} did not end within {timeout_s}s"
    return events


def wait_for(client: CoordinatorClient, run_id: str, kind: int, timeout_s: float = 120) -> pb.RunEvent:
    deadline = time.time() + timeout_s
    for ev in client.watch(run_id):
        if ev.kind == kind:
            return ev
        assert time.time() < deadline
    raise AssertionError(f"run {run_id} ended without a {pb.EventKind.Name(kind)} event")


def metric_events(events: list[pb.RunEvent]) -> list[dict[str, float]]:
    return [dict(ev.metrics) for ev in events if ev.kind == pb.EVENT_KIND_STEP]
