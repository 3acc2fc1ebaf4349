"""The cluster's `WorkerGroup`: one Ray actor per rank, in a placement group of one bundle per rank.

Ray is confined here: a worker's death (`RayActorError`) becomes `WorkerDied`,
an error a rank's method raised comes out as itself, and placement that does
not come in time is `NoRoom`. The actors are named `LearnerWorker` (their
processes are `ray::LearnerWorker`, which the fault tests and benchmarks find
by name). Ranks meet through a rendezvous file: no TCP listener.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Concatenate

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlserve import cpu_affinity
from rlserve.learner.publisher import StorePublishing
from rlserve.learner.worker_group import NoRoom, P, T, WorkerDied, WorkerGroup, WorkerLayout
from rlserve.learner.worker_host import WorkerHost
from rlserve.training.distributed import device_for, init_process_group


class LearnerWorker(WorkerHost):
    """A rank's `WorkerHost` in a Ray actor: it sets up its process (cores, threads, device,
    torch.distributed) and publishes into the cluster's weight store."""

    def __init__(self, rank: int, world_size: int, init_method: str, device: str, torch_threads: int):
        cpu_affinity.place_from_env()
        # At most one thread per core of this machine, whatever the spec asks (SubmitRun checks it too).
        torch_threads = min(torch_threads, os.cpu_count() or 1)
        torch.set_num_threads(torch_threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(torch_threads))
        if device == "auto":  # the GPU Ray gave this worker (num_gpus: cluster.gpus_per_worker), if any
            device = "cuda" if ray.get_gpu_ids() else "cpu"
        torch_device = device_for(device, local_rank=0)  # Ray gives each worker its own visible GPU
        init_process_group(rank, world_size, init_method, torch_device)
        super().__init__(rank, torch_device, StorePublishing())


_RemoteWorker = ray.remote(LearnerWorker)


class RayWorkerGroup(WorkerGroup):
    """`LearnerWorker` actors, one per bundle of a PACK placement group (a restart starts a new one)."""

    def __init__(self, layout: WorkerLayout, placement_timeout_s: float):
        self.layout, self.placement_timeout_s = layout, placement_timeout_s
        self.pg: PlacementGroup | None = None
        self.workers: list = []
        self.rendezvous: Path | None = None

    @classmethod
    async def start(cls, layout: WorkerLayout, placement_timeout_s: float) -> RayWorkerGroup:
        """A group of `layout`, its resources waited for at most `placement_timeout_s` (then NoRoom)."""
        group = cls(layout, placement_timeout_s)
        await group._start()
        return group

    async def _start(self) -> None:
        lay = self.layout
        pg = placement_group([{"CPU": lay.cpus_per_worker, "GPU": lay.gpus_per_worker}] * lay.num_workers,
                             strategy="PACK")
        try:
            await asyncio.wait_for(pg.ready(), self.placement_timeout_s)
        except asyncio.TimeoutError:
            remove_placement_group(pg)
            raise NoRoom(f"no room for {lay.num_workers} learner workers of {lay.cpus_per_worker} CPU / "
                         f"{lay.gpus_per_worker} GPU within {self.placement_timeout_s:.0f}s") from None
        self.pg = pg
        self.rendezvous = Path(tempfile.mkdtemp(prefix="rlserve-learner-")) / "rendezvous"
        # The service's cpu_cores (if any) and nice carry on to its workers.
        env = {"OMP_NUM_THREADS": str(min(lay.torch_threads, os.cpu_count() or 1)),
               cpu_affinity.ENV: os.environ.get(cpu_affinity.ENV, ""),
               cpu_affinity.NICE_ENV: os.environ.get(cpu_affinity.NICE_ENV, "")}
        self.workers = [_RemoteWorker.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            num_cpus=lay.cpus_per_worker, num_gpus=lay.gpus_per_worker, runtime_env={"env_vars": env},
        ).remote(rank, lay.num_workers, f"file://{self.rendezvous}", lay.device, lay.torch_threads)
            for rank in range(lay.num_workers)]

    async def call_all(self, method: Callable[Concatenate[WorkerHost, P], T], *args: P.args,
                       **kwargs: P.kwargs) -> list[T]:
        name = method.__name__
        try:
            return await asyncio.gather(*[getattr(w, name).remote(*args, **kwargs) for w in self.workers])
        except ray.exceptions.RayActorError as err:
            raise WorkerDied(type(err).__name__) from err
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, Exception):  # what the rank's method raised, not Ray's wrapper
                raise err.cause from err
            raise

    async def restart(self) -> None:
        self.close()
        await self._start()

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        if self.pg is not None:
            remove_placement_group(self.pg)
        if self.rendezvous is not None:
            shutil.rmtree(self.rendezvous.parent, ignore_errors=True)
        self.pg, self.workers, self.rendezvous = None, [], None
