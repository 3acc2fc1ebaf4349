"""The weight store: the newest policy version, once, for replicas that start late or missed a transfer.

One named actor that every rollout replica and the learner can find. It
keeps the newest publication: the bucket ObjectRefs the learner put (never
copied again here), or a safetensors folder. A replica that starts, restarts
or missed a direct transfer loads it. The buckets live as long as the learner
session that put them (Ray 2.56 removed `ray.put`'s `_owner`, and a second
copy owned here would double the cost of every version); a learner that
restarts restores its checkpoint and publishes again.

LoRA runs on the deployed base (`shared_base`) publish beside the head, each
under its own run id: many runs' adapters are served at once, and a replica
loads a run's adapter when a request of that run needs it
(`rlserve.rollout.adapters`). The learner drops a run's adapter when its
session ends; `MAX_ADAPTERS` bounds how many the store holds.

The store tells nobody about a publication: whoever publishes announces it to
the fleet (`fleet.py`), and a replica compares `head()` with what it serves
before each request, which covers a notice still on its way (or lost with a
publisher that died in between).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import ray

STORE_NAMESPACE = "rlserve"
DEFAULT_STORE_NAME = "rlserve-weights"
# Runs' adapters held at once (one version each); the oldest publication goes first beyond it.
MAX_ADAPTERS = 1024


@dataclass(frozen=True)
class Publication:
    publish_id: int  # increases with every publication; replicas compare it with theirs
    run_id: str
    version: int
    num_tensors: int
    num_bytes: int
    # Replicas apply it to the requests they are running (their samples then span versions);
    # otherwise those finish on the old weights first.
    in_flight: bool = False
    safetensors_path: str | None = None
    # Held inside a list so that Ray hands over the refs instead of resolving them.
    bucket_refs: list[Any] = field(default_factory=list)
    # A LoRA adapter's PEFT config when the tensors are an adapter for the deployed base model
    # (`rlserve.weights.adapter`); None: the model's own weights.
    adapter_config: dict | None = None


@ray.remote(num_cpus=0)
class WeightStore:
    def __init__(self) -> None:
        self._head: Publication | None = None
        self._adapters: dict[str, Publication] = {}  # shared_base runs' newest adapters, oldest first
        self._adapter_ids = 0

    async def publish(self, run_id: str, version: int, bucket_refs: list[Any], num_tensors: int, num_bytes: int,
                      in_flight: bool, safetensors_path: str | None = None, adapter_config: dict | None = None
                      ) -> int:
        """Make a version the newest (its previous one is released); returns its publish id."""
        publish_id = (self._head.publish_id if self._head else 0) + 1
        self._head = Publication(publish_id, run_id, version, num_tensors, num_bytes, in_flight, safetensors_path,
                                 list(bucket_refs), adapter_config)
        return publish_id

    async def head(self) -> tuple[int, str, int] | None:
        """(publish_id, run_id, version) of the newest publication, without its refs."""
        if self._head is None:
            return None
        return self._head.publish_id, self._head.run_id, self._head.version

    async def latest(self) -> Publication | None:
        return self._head

    async def publish_adapter(self, run_id: str, version: int, bucket_refs: list[Any], num_tensors: int,
                              num_bytes: int, adapter_config: dict) -> int:
        """Make `version` the run's newest adapter (its previous one is released); returns its publish id."""
        self._adapter_ids += 1
        self._adapters.pop(run_id, None)
        self._adapters[run_id] = Publication(self._adapter_ids, run_id, version, num_tensors, num_bytes,
                                             bucket_refs=list(bucket_refs), adapter_config=adapter_config)
        while len(self._adapters) > MAX_ADAPTERS:
            self._adapters.pop(next(iter(self._adapters)))
        return self._adapter_ids

    async def adapter_head(self, run_id: str) -> tuple[int, int] | None:
        """(publish_id, version) of the run's newest adapter, without its refs."""
        pub = self._adapters.get(run_id)
        return None if pub is None else (pub.publish_id, pub.version)

    async def adapter(self, run_id: str) -> Publication | None:
        return self._adapters.get(run_id)

    async def drop_adapter(self, run_id: str) -> bool:
        return self._adapters.pop(run_id, None) is not None


async def fetch_tensors(pub: Publication) -> dict[str, Any]:
    """A publication's tensors from the object store; UNAVAILABLE when they are gone (the learner session
    that put them ended)."""
    from rlserve.rpc import unavailable

    tensors: dict[str, Any] = {}
    try:
        for bucket in await asyncio.gather(*pub.bucket_refs):
            tensors.update(bucket)
    except ray.exceptions.RayError as err:
        raise unavailable(f"run {pub.run_id!r}: version {pub.version} is no longer in the object store: "
                          f"{type(err).__name__}") from None
    return tensors


def named_on_head(actor_cls: Any, name: str) -> ray.actor.ActorHandle:
    """The named actor `name` of `actor_cls`, created on first use. It outlives its creator (detached)
    and lives on the head node, so losing another node (say, the one running the rollout replicas)
    loses no published version and no fleet."""
    return actor_cls.options(name=name, namespace=STORE_NAMESPACE, get_if_exists=True, lifetime="detached",
                             resources={"node:__internal_head__": 0.001}).remote()


def get_store(name: str) -> ray.actor.ActorHandle:
    """The weight store `name` (services are configured with it; `DEFAULT_STORE_NAME` unless set)."""
    return named_on_head(WeightStore, name)
