"""Weight sync after every training step: learner -> rollout engines directly, plus the weight store's copy."""

from __future__ import annotations

import time

from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2, rollout_pb2
from services.coordinator.context import Context


async def sync_weights(ctx: Context) -> dict[str, float]:
    """Learner -> rollout engines (directly where they run a weight-transfer engine) and the weight store;
    then make sure a replica serves it (one that missed the direct transfer loads the store copy)."""
    in_flight = ctx.spec.grpo.async_grpo.in_flight_weight_updates
    t0 = time.perf_counter()
    exported = await ctx.calls.export_weights(learner_pb2.ExportWeightsRequest(
        run_id=ctx.run.run_id, store_name=ctx.settings.weight_store, direct=True, in_flight=in_flight))
    applied = await ctx.calls.update_weights(rollout_pb2.UpdateWeightsRequest(
        version=exported.weight_version, store_name=ctx.settings.weight_store, in_flight=in_flight))
    seconds = time.perf_counter() - t0
    ctx.run.version = exported.weight_version
    how = (f"sent directly to {exported.receivers} rollout replicas" if exported.receivers else
           f"loaded by rollout replica {applied.replica_id} from the store")
    failed = f"; {len(exported.failed)} dropped out (catching up from the store)" if exported.failed else ""
    ctx.emit(pb.EVENT_KIND_WEIGHT_SYNC, f"version {exported.weight_version} published "
             f"({exported.num_tensors} tensors in {exported.num_buckets} buckets, "
             f"{exported.num_bytes / 2**20:.1f} MiB) and {how}{failed}",
             {"weight_sync/seconds": seconds, "weight_sync/export_s": exported.seconds,
              "weight_sync/apply_s": applied.apply_seconds, "weight_sync/mib": exported.num_bytes / 2**20,
              "weight_sync/direct_mib": exported.direct_bytes / 2**20,
              "weight_sync/store_fetch_mib": applied.num_bytes / 2**20})
    ctx.progress()
    return {"timing/weight_sync_s": seconds, "weight_sync/direct_mib": exported.direct_bytes / 2**20,
            "weight_sync/store_fetch_mib": applied.num_bytes / 2**20,
            "plumbing/weight_sync_s": seconds - exported.seconds - applied.fetch_seconds - applied.apply_seconds}
