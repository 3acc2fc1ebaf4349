"""The learner's session table and heal policy over in-process worker groups: real backends on the tiny
model (CPU, gloo, one rank), no Ray. A worker's death is what `InProcessWorkerGroup.kill_during` makes
of it: the call runs, then the worker and every run's state in it are gone before it answers, as a
rank killed mid-call (the live-cluster version: tests/integration/test_lora_runs.py)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest
import torch

from rlserve.config import RunSpec, parse_spec
from rlserve.learner.in_process_group import InProcessWorkerGroup
from rlserve.learner.publishing import Publishing
from rlserve.learner.sessions import SessionTable
from rlserve.learner.worker_group import NoRoom, WorkerLayout
from rlserve.learner.worker_host import WorkerHost
from rlserve.rpc import RpcError
from rlserve.training.batch import TrainBatch
from tests.support.batches import random_grpo_sequences


def spec(lora: bool = True) -> RunSpec:
    lora_cfg = {"enabled": lora, "dim": 4, "dropout": 0.0} if lora else {"enabled": False}
    return parse_spec({"policy": {"model_name": "preset:tiny", "dtensor_cfg": {"lora_cfg": lora_cfg},
                                  "train_global_batch_size": 4, "train_micro_batch_size": 4,
                                  "max_total_sequence_length": 32, "generation": {"max_new_tokens": 8}},
                       "cluster": {"device": "cpu"}})


def batch(seed: int) -> TrainBatch:
    """4 sequences: one optimizer update of one micro-batch (the tests count steps, not what they learn)."""
    return TrainBatch.from_sequences(*(column[:4] for column in random_grpo_sequences(seed)))


def run(coro):
    return asyncio.run(coro)


async def shared_table(model: Path, publishing: Publishing, *run_ids: str) -> SessionTable:
    """A table with `run_ids` configured on the shared base (one group)."""
    table = SessionTable(InProcessWorkerGroup.starter(publishing))
    for run_id in run_ids:
        await table.configure(run_id, spec(), model, None, shared_base=True)
    return table


def workers(table: SessionTable, run_id: str) -> InProcessWorkerGroup:
    return table.sessions[run_id].group.workers


def adapters(host: WorkerHost, run_id: str) -> dict[str, torch.Tensor]:
    backend = host.runs[run_id].backend
    return {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


async def step(table: SessionTable, run_id: str, seed: int, expected: int | None = None) -> int:
    return (await table.train_step(run_id, batch(seed), "grpo", None, expected)).version


def test_a_worker_dying_mid_step_heals_the_shared_group_and_every_run_goes_on_from_its_snapshot(model, publishing):
    async def main():
        table = await shared_table(model, publishing, "a", "b")
        group = workers(table, "a")
        assert workers(table, "b") is group and len(table.groups) == 1
        assert [await step(table, "a", 0), await step(table, "a", 1), await step(table, "b", 2)] == [1, 2, 1]
        b_before = adapters(group.host, "b")

        group.kill_during(WorkerHost.train_step, "a")
        # The step ran, the worker died before answering: new workers, each run loaded from its snapshot,
        # the step retried once (applied once: from version 2 to 3).
        assert await step(table, "a", 3) == 3
        assert group.restarts == 1 and sorted(table.sessions) == ["a", "b"] and workers(table, "b") is group
        assert same(adapters(group.host, "b"), b_before)  # b restored as it was, not configured afresh
        assert await step(table, "b", 4) == 2
        # A retried call (the caller missed the answer) gets the answer, without a second step.
        assert await step(table, "b", 4, expected=1) == 2 and table.sessions["b"].version == 2

    run(main())


def test_a_call_that_kills_the_workers_twice_loses_its_run_alone(model, publishing):
    async def main():
        table = await shared_table(model, publishing, "a", "b")
        group = workers(table, "a")
        await step(table, "a", 0)
        await step(table, "b", 1)
        group.kill_during(WorkerHost.train_step, "a", times=2)
        with pytest.raises(RpcError) as err:
            await step(table, "a", 2)
        assert err.value.code == grpc.StatusCode.ABORTED and "died twice" in err.value.message
        assert group.restarts == 2 and sorted(table.sessions) == ["b"] and "a" not in group.host.runs
        assert await step(table, "b", 3) == 2
        with pytest.raises(RpcError) as err:
            await step(table, "a", 4)
        assert err.value.code == grpc.StatusCode.ABORTED and "call Configure" in err.value.message

    run(main())


def test_a_run_whose_last_snapshot_failed_loses_its_session_alone_when_the_group_heals(model, publishing):
    async def main():
        table = await shared_table(model, publishing, "a", "b")
        await step(table, "b", 0)
        # a's snapshot folder becomes a file (its disk fails): a's step stands, its snapshot does not.
        folder = table.sessions["a"].snapshots.folders[0].parent
        shutil.rmtree(folder)
        folder.write_text("not a folder")
        try:
            assert await step(table, "a", 1) == 1 and table.sessions["a"].snapshots.failed
            workers(table, "b").kill_during(WorkerHost.train_step, "b")
            assert await step(table, "b", 2) == 2
        finally:
            folder.unlink()
        assert sorted(table.sessions) == ["b"] and "a" not in workers(table, "b").host.runs

    run(main())


def test_a_death_while_writing_a_snapshot_restores_the_other_folder(model, publishing):
    async def main():
        table = await shared_table(model, publishing, "a")
        snapshots = table.sessions["a"].snapshots
        await step(table, "a", 0)
        assert snapshots.whole == snapshots.folders[0]
        await step(table, "a", 1)
        assert snapshots.whole == snapshots.folders[1]  # written in turn
        workers(table, "a").kill_during(WorkerHost.save_snapshot, "a")
        # The step's snapshot into folders[0] dies: the run is restored from folders[1] (version 2), the step
        # retried, and its snapshot written again.
        assert await step(table, "a", 2) == 3
        assert snapshots.whole == snapshots.folders[0] and not snapshots.failed

    run(main())


def test_a_snapshot_restores_a_run_on_other_workers_exactly(model, publishing, tmp_path):
    """Snapshot -> load on another group's worker -> the same adapters and version, and the next step gives
    the same loss on both."""
    async def main():
        groups = [InProcessWorkerGroup(WorkerLayout.of(spec()), publishing) for _ in range(2)]
        for group in groups:
            await group.call_all(WorkerHost.configure, "a", spec(), model, None, False)
        for seed in range(2):
            await groups[0].call_all(WorkerHost.train_step, "a", batch(seed), "grpo", None)
        await groups[0].call_all(WorkerHost.save_snapshot, "a", tmp_path / "snap")
        assert await groups[1].call_all(WorkerHost.load_snapshot, "a", tmp_path / "snap") == [2]
        assert same(adapters(groups[0].host, "a"), adapters(groups[1].host, "a"))
        after = [(await g.call_all(WorkerHost.train_step, "a", batch(2), "grpo", None))[0] for g in groups]
        assert after[0].version == after[1].version == 3
        assert after[0].metrics["loss/total"] == after[1].metrics["loss/total"]

    run(main())


def test_release_ends_a_runs_backend_and_the_last_run_ends_its_group(model, publishing):
    async def main():
        table = await shared_table(model, publishing, "a", "b")
        group = workers(table, "a")
        await step(table, "a", 0)
        published = await table.export("a", "store", False, False, 1.0, shared_base=True)
        assert published.version == 1 and published.num_tensors > 0
        folder = table.sessions["a"].snapshots.folders[0].parent
        assert folder.is_dir()

        assert await table.release("a") is True
        assert sorted(group.host.runs) == ["b"] and sorted(table.sessions) == ["b"] and not folder.exists()
        assert publishing.dropped == [("store", "a")]  # its adapter leaves the weight store
        assert await table.release("a") is False
        assert await table.release("b") is True
        assert table.groups == [] and group.host is None  # the workers are closed

    run(main())


def test_a_run_that_trains_alone_ends_stale_sessions_and_a_death_in_its_own_group_ends_it(model, publishing):
    async def main():
        table = await shared_table(model, publishing, "a", "b")
        shared_group = workers(table, "a")
        await table.configure("full", spec(lora=False), model, None, shared_base=False)
        assert sorted(table.sessions) == ["full"] and shared_group.host is None
        assert await step(table, "full", 0) == 1
        workers(table, "full").kill_during(WorkerHost.train_step)
        with pytest.raises(RpcError) as err:  # no heal: the run restores its own checkpoint
            await step(table, "full", 1)
        assert err.value.code == grpc.StatusCode.ABORTED and "a learner worker died (killed)" in err.value.message
        assert table.sessions == {} and table.groups == []
        with pytest.raises(RpcError) as err:
            await table.configure("lora", spec(lora=False), model, None, shared_base=True)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.message.startswith("shared_base:")

    run(main())


class _NoRoomToRestart(InProcessWorkerGroup):
    async def restart(self) -> None:
        raise NoRoom("no room for 1 learner workers of 0.5 CPU / 0.0 GPU within 0s")


def test_a_shared_group_that_cannot_heal_ends_with_every_session_in_it(model, publishing):
    async def main():
        async def start(layout: WorkerLayout) -> InProcessWorkerGroup:
            return _NoRoomToRestart(layout, publishing)

        table = SessionTable(start)
        for run_id in ("a", "b"):
            await table.configure(run_id, spec(), model, None, shared_base=True)
        workers(table, "a").kill()
        with pytest.raises(RpcError) as err:
            await step(table, "a", 0)
        assert err.value.code == grpc.StatusCode.ABORTED and "sessions of its group (a, b) are gone" in err.value.message
        assert table.sessions == {} and table.groups == []

    run(main())


def test_no_room_for_a_runs_workers_is_resource_exhausted(model):
    async def main():
        async def start(layout: WorkerLayout) -> InProcessWorkerGroup:
            raise NoRoom(f"no room for {layout.num_workers} learner workers")

        with pytest.raises(RpcError) as err:
            await SessionTable(start).configure("a", spec(), model, None, shared_base=False)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "no room for 1 learner workers" in err.value.message

    run(main())
