"""Weight sync: learner -> weight store -> rollout, after every training step."""

from __future__ import annotations

import time

from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2, rollout_pb2
from services.coordinator.context import Context


async def sync_weights(ctx: Context) -> dict[str, float]:
    """Learner -> weight store -> rollout: publish the learner's version, load it on a rollout replica."""
    t0 = time.perf_counter()
    exported = await ctx.calls.export_weights(learner_pb2.ExportWeightsRequest(
        run_id=ctx.run.run_id, store_name=ctx.settings.weight_store))
    applied = await ctx.calls.update_weights(rollout_pb2.UpdateWeightsRequest(
        version=exported.weight_version, store_name=ctx.settings.weight_store))
    seconds = time.perf_counter() - t0
    ctx.run.version = exported.weight_version
    ctx.emit(pb.EVENT_KIND_WEIGHT_SYNC, f"version {exported.weight_version} published "
             f"({exported.num_tensors} tensors in {exported.num_buckets} buckets, "
             f"{exported.num_bytes / 2**20:.1f} MiB) and loaded by rollout replica {applied.replica_id}",
             {"weight_sync/seconds": seconds, "weight_sync/export_s": exported.seconds,
              "weight_sync/apply_s": applied.apply_seconds, "weight_sync/mib": exported.num_bytes / 2**20})
    ctx.progress()
    return {"timing/weight_sync_s": seconds,
            "plumbing/weight_sync_s": seconds - exported.seconds - applied.fetch_seconds - applied.apply_seconds}
