"""Weight sync: learner -> rollout engines directly, plus the weight store's copy.

An RL run publishes after every training step; any run publishes before it validates. The sync is
the writer of the published version: the producer learns it through the step queue, the run record
with the step that made it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rlserve.loop.inputs import RunInputs
from rlserve.loop.services import RunServices
from rlserve.runs.record import Run
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2, rollout_pb2


class WeightSync:
    def __init__(self, inputs: RunInputs, run: Run, services: RunServices, weight_store: str,
                 progress: Callable[[], None]):
        self.inputs, self.run, self.services = inputs, run, services
        self.weight_store = weight_store
        self.progress = progress
        self.version: int | None = None  # the version the engines were last sent (None: none yet)

    async def ensure_published(self, version: int) -> None:
        """The engines serve `version` (the learner's) before anything samples from it."""
        if self.version != version:
            await self.publish()

    async def publish(self) -> dict[str, float]:
        """Learner -> rollout engines (directly where they run a weight-transfer engine) and the weight store;
        then, unless every replica took it directly, make sure a replica serves it (one that missed the direct
        transfer loads the store copy)."""
        in_flight = self.inputs.spec.grpo.async_grpo.in_flight_weight_updates
        shared = self.inputs.spec.shares_deployed_base
        t0 = time.perf_counter()
        exported = await self.services.export_weights(learner_pb2.ExportWeightsRequest(
            run_id=self.inputs.run_id, store_name=self.weight_store, direct=True, in_flight=in_flight,
            shared_base=shared))
        if exported.receivers and not exported.failed:  # every replica in the fleet loaded it at the round's finish
            applied = rollout_pb2.UpdateWeightsResponse(weight_version=exported.weight_version)
        else:
            applied = await self.services.update_weights(rollout_pb2.UpdateWeightsRequest(
                version=exported.weight_version, store_name=self.weight_store, in_flight=in_flight,
                run_id=self.inputs.run_id if shared else "", shared_base=shared))
        seconds = time.perf_counter() - t0
        self.version = exported.weight_version
        how = (f"sent directly to {exported.receivers} rollout replicas" if exported.receivers else
               f"loaded by rollout replica {applied.replica_id} from the store" + (
                   " (served beside other runs' adapters; the other replicas load it on this run's next request "
                   "there)" if shared else ""))
        failed = f"; {len(exported.failed)} dropped out (catching up from the store)" if exported.failed else ""
        what = (f"LoRA adapter tensors, {exported.num_bytes / 2**20:.2f} MiB of a "
                f"{exported.model_bytes / 2**20:.1f} MiB model" if self.inputs.spec.policy.lora.enabled
                else f"tensors, {exported.num_bytes / 2**20:.1f} MiB")
        self.run.emit(pb.EVENT_KIND_WEIGHT_SYNC, f"version {exported.weight_version} published "
                      f"({exported.num_tensors} {what} in {exported.num_buckets} buckets) and {how}{failed}",
                      {"weight_sync/seconds": seconds, "weight_sync/export_s": exported.seconds,
                       "weight_sync/direct_s": exported.direct_seconds, "weight_sync/store_copy_s": exported.store_seconds,
                       "weight_sync/apply_s": applied.apply_seconds, "weight_sync/mib": exported.num_bytes / 2**20,
                       "weight_sync/model_mib": exported.model_bytes / 2**20,
                       "weight_sync/direct_mib": exported.direct_bytes / 2**20,
                       "weight_sync/store_fetch_mib": applied.num_bytes / 2**20})
        self.progress()
        return {"timing/weight_sync_s": seconds, "weight_sync/mib": exported.num_bytes / 2**20,
                "weight_sync/model_mib": exported.model_bytes / 2**20,
                "weight_sync/direct_mib": exported.direct_bytes / 2**20,
                "weight_sync/store_fetch_mib": applied.num_bytes / 2**20,
                "weight_sync/direct_s": exported.direct_seconds, "weight_sync/store_copy_s": exported.store_seconds,
                "plumbing/weight_sync_s": seconds - exported.seconds - applied.fetch_seconds - applied.apply_seconds}
