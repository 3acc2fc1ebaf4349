"""A rollout replica's side of the weight store: follow the newest publication.

A handle call reaches one replica, so weights are not pushed to replicas:
the learner publishes a version in the store (`store.py`) and every replica
pulls the newest publication before it serves its next request, and before
it serves at all when it (re)starts. Every update is validated against the
served model's checkpoint layout before the engine sees it (a failed reload
can leave vLLM broken), and the old weights keep serving on any error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from rlserve.logs import event
from rlserve.rollout.interfaces import RolloutEngine
from rlserve.rpc import RpcError, failed_precondition, invalid_argument, unavailable
from rlserve.threads import in_thread_to_the_end
from rlserve.weights.specs import TensorSpec, check_update, checkpoint_specs
from rlserve.weights.store import Publication

log = logging.getLogger("rlserve.rollout")


@dataclass(frozen=True)
class Applied:
    version: int
    num_tensors: int
    num_bytes: int
    fetch_seconds: float
    apply_seconds: float


class WeightFollower:
    """Keeps one engine on the newest publication of one store. Callers serialise the calls."""

    def __init__(self, store: ray.actor.ActorHandle, engine: RolloutEngine, specs: dict[str, TensorSpec],
                 replica_id: str):
        self.store, self.engine, self.specs, self.replica_id = store, engine, specs, replica_id
        self.publish_id = 0
        self.run_id = ""
        self.version = 0

    def catch_up(self) -> None:
        """At start: load the newest publication, if any (blocking); an unusable one is skipped with a warning."""
        latest = ray.get(self.store.latest.remote())
        if latest is None:
            return
        try:
            self.apply(latest)
        except RpcError as err:  # serve the deployed weights until the next publication
            self.publish_id = latest.publish_id
            event(log, "rollout.publication_unusable", logging.WARNING, replica=self.replica_id,
                  version=latest.version, error=err.message)

    async def sync(self) -> None:
        """Move to the newest publication if this replica is behind."""
        head = await self.store.head.remote()
        if head is not None and head[0] > self.publish_id:
            pub = await self.store.latest.remote()
            await in_thread_to_the_end(self.apply, pub)

    async def update_to(self, version: int) -> Applied | None:
        """Load `version`, which must be the newest publication; None when it is already loaded."""
        pub = await self.store.latest.remote()
        if pub is None or pub.version != version:
            have = "nothing" if pub is None else f"version {pub.version}"
            raise failed_precondition(f"version {version} is not the newest publication ({have})")
        if pub.publish_id == self.publish_id:
            return None
        return await in_thread_to_the_end(self.apply, pub)

    async def publish_folder(self, path: Path, version: int, force: bool) -> None:
        """Publish a folder of HF-named safetensors (checked first), so that every replica moves to it."""
        if not any(path.glob("*.safetensors")):
            raise invalid_argument("safetensors_path", f"{path}: no *.safetensors files")
        if version <= self.version and not force:
            raise invalid_argument("version", f"{version} is not newer than the served {self.version} "
                                              f"(set force to load it anyway)")
        problems = check_update(self.specs, checkpoint_specs(path))
        if problems:
            raise invalid_argument("safetensors_path", "; ".join(problems[:5]))
        num_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        await self.store.publish.remote(self.run_id, version, [], len(self.specs), num_bytes, str(path))

    def apply(self, pub: Publication) -> Applied:
        """Fetch, validate, then load one publication."""
        t0 = time.perf_counter()
        if pub.safetensors_path:
            got = checkpoint_specs(pub.safetensors_path)
            tensors = None
        else:
            tensors = self._fetch(pub)
            got = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in tensors.items()}
        problems = check_update(self.specs, got)
        if problems:
            raise invalid_argument("weights", "; ".join(problems[:5]))
        t1 = time.perf_counter()
        try:
            if tensors is None:
                self.engine.load_weights_from_path(Path(pub.safetensors_path))
            else:
                self.engine.load_weights(tensors.items())
        except ValueError as err:
            raise failed_precondition(str(err)) from None
        t2 = time.perf_counter()
        self.publish_id, self.run_id, self.version = pub.publish_id, pub.run_id, pub.version
        event(log, "rollout.weights_applied", replica=self.replica_id, run=pub.run_id or None,
              version=pub.version, tensors=len(got), fetch_s=t1 - t0, apply_s=t2 - t1)
        return Applied(pub.version, len(got), pub.num_bytes, t1 - t0, t2 - t1)

    @staticmethod
    def _fetch(pub: Publication) -> dict[str, torch.Tensor]:
        tensors: dict[str, Any] = {}
        try:
            for bucket in ray.get(pub.bucket_refs):
                tensors.update(bucket)
        except ray.exceptions.RayError as err:
            raise unavailable(f"weights of version {pub.version} are no longer in the object store "
                              f"(the learner that published them is gone): {type(err).__name__}") from None
        return tensors
