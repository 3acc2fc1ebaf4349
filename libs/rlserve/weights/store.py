"""The weight store: where each new policy version is published for every rollout replica.

A handle call reaches one replica, so the learner does not push weights to
replicas; it publishes a version here (bucket ObjectRefs in the object store,
or a safetensors folder) and every rollout replica pulls the newest
publication before it serves its next request. A replica that starts or
restarts loads the newest publication before it serves at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

STORE_NAMESPACE = "rlserve"
DEFAULT_STORE_NAME = "rlserve-weights"


@dataclass(frozen=True)
class Publication:
    publish_id: int  # increases with every publication; replicas compare it with theirs
    run_id: str
    version: int
    num_tensors: int
    num_bytes: int
    safetensors_path: str | None = None
    # Held inside a list so that Ray hands over the refs instead of resolving them.
    bucket_refs: list[Any] = field(default_factory=list)


@ray.remote(num_cpus=0)
class WeightStore:
    """Keeps the newest publication (and so keeps its buckets alive)."""

    def __init__(self) -> None:
        self._head: Publication | None = None

    def publish(self, run_id: str, version: int, bucket_refs: list[Any], num_tensors: int, num_bytes: int,
                safetensors_path: str | None = None) -> int:
        """Take ownership of the buckets (one copy), so that a version outlives the learner worker
        that exported it: a rollout replica restarting after the learner moved on can still load it."""
        owned = [ray.put(bucket) for bucket in ray.get(list(bucket_refs))]
        publish_id = (self._head.publish_id if self._head else 0) + 1
        self._head = Publication(publish_id, run_id, version, num_tensors, num_bytes, safetensors_path, owned)
        return publish_id

    def head(self) -> tuple[int, str, int] | None:
        """(publish_id, run_id, version) of the newest publication, without its refs."""
        if self._head is None:
            return None
        return self._head.publish_id, self._head.run_id, self._head.version

    def latest(self) -> Publication | None:
        return self._head


def get_store(name: str = DEFAULT_STORE_NAME) -> ray.actor.ActorHandle:
    """The named store, created on first use; it outlives its creator (detached) and lives on the head
    node, so losing another node (say, the one running the rollout replicas) loses no published version."""
    return WeightStore.options(name=name, namespace=STORE_NAMESPACE, get_if_exists=True, lifetime="detached",
                               resources={"node:__internal_head__": 0.001}).remote()
