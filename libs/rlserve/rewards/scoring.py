"""Score a batch item by item: one failing item never fails the batch."""

from __future__ import annotations

import json
import logging
import time

from rlserve.logs import event
from rlserve.rewards.config import BadFunction, RewardFunctionCfg
from rlserve.rewards.interfaces import RewardInput
from rlserve.rewards.loader import CombinedReward
from rlserve.rpc import invalid_argument
from rlserve.security.plugins import PluginPolicy
from rlserve.v1 import reward_pb2

log = logging.getLogger("rlserve.reward")


def functions_from_proto(functions: list[reward_pb2.RewardFunctionSpec],
                         plugins: PluginPolicy) -> list[RewardFunctionCfg]:
    """The request's functions; a plug-in by import path, and a reward model's folder, must be on the
    operator's allow-list."""
    specs = []
    for i, f in enumerate(functions):
        try:
            spec = RewardFunctionCfg.from_proto(f)
        except BadFunction as err:
            raise invalid_argument(f"functions[{i}].{err.field}", err.problem) from None
        plugins.check_function(f"functions[{i}]", spec)
        specs.append(spec)
    return specs


def score_batch(reward: CombinedReward, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
    """Every item at once (model-backed functions batch them); one item's failure is that item's status."""
    t0 = time.perf_counter()
    inputs = []
    for i, item in enumerate(request.items):
        try:
            metadata = json.loads(item.metadata_json) if item.metadata_json else {}
        except json.JSONDecodeError as err:
            raise invalid_argument(f"items[{i}].metadata_json", f"not JSON: {err.msg}") from None
        inputs.append(RewardInput(item.prompt, item.completion, item.reference_answer, metadata))
    results, errors = [], 0
    for i, (item, out) in enumerate(zip(request.items, reward.score_many(inputs) if inputs else [])):
        if isinstance(out, Exception):
            errors += 1
            message = f"{type(out).__name__}: {out}"[:300]
            event(log, "reward.item_error", logging.WARNING, run=request.run_id or None, item=item.id or i,
                  error=message)
            results.append(reward_pb2.ScoreResult(id=item.id, score=0.0, status=reward_pb2.SCORE_STATUS_ERROR,
                                                  error=message))
            continue
        results.append(reward_pb2.ScoreResult(id=item.id, score=out.total, status=reward_pb2.SCORE_STATUS_OK,
                                              components=out.components, metrics=out.metrics,
                                              info_json=json.dumps(out.info, default=str) if out.info else ""))
    return reward_pb2.ScoreResponse(results=results, num_errors=errors, reward_version=reward.version,
                                    compute_seconds=time.perf_counter() - t0)
