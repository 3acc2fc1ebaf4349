"""The reference Serve application: `rlserve.v1.Reference` (frozen-policy logprobs for the KL term)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from pathlib import Path

from pydantic import BaseModel, ConfigDict
from ray import serve

from rlserve.cluster.deployment import assigned_device, build_app
from rlserve.cpu_affinity import place_from_env
from rlserve.logs import event, setup_logging
from rlserve.models import resolve_model
from rlserve.reference.scorer import ReferenceScorer, Sequence
from rlserve.rpc import grpc_method, invalid_argument
from rlserve.security.paths import PathsArgs
from rlserve.v1 import reference_pb2

log = logging.getLogger("rlserve.reference")


class ReferenceArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "preset:tiny"
    model_seed: int = 0
    dtype: str = "float32"
    token_budget: int = 8192
    # Reference models kept loaded (runs may name their own reference folder).
    max_models: int = 2
    # A request's model_path must lie in the model directories or the runs directory.
    paths: PathsArgs = PathsArgs()


@serve.deployment(max_ongoing_requests=8)
class Reference:
    def __init__(self, args: dict | None = None):
        setup_logging()
        place_from_env()
        self.args = ReferenceArgs.model_validate(args or {})
        self.paths = self.args.paths.policy()
        self.default_path = resolve_model(self.args.model, self.args.model_seed)
        self.scorers: OrderedDict[str, ReferenceScorer] = OrderedDict()
        self.lock = asyncio.Lock()
        self.device = assigned_device()
        self._scorer(str(self.default_path))
        event(log, "reference.ready", model=self.default_path, device=self.device)

    def _scorer(self, path: str) -> ReferenceScorer:
        if path in self.scorers:
            self.scorers.move_to_end(path)
            return self.scorers[path]
        if not (Path(path) / "config.json").is_file():
            raise invalid_argument("model_path", f"{path} is not an HF model folder")
        scorer = ReferenceScorer(Path(path), self.args.dtype, self.args.token_budget, self.device)
        self.scorers[path] = scorer
        while len(self.scorers) > self.args.max_models:
            self.scorers.popitem(last=False)
        return scorer

    @grpc_method
    async def LogProbs(self, request: reference_pb2.LogProbsRequest) -> reference_pb2.LogProbsResponse:
        if not request.sequences:
            raise invalid_argument("sequences", "empty request")
        async with self.lock:
            path = self.paths.model_name("model_path", request.model_path) if request.model_path else None
            scorer = await asyncio.to_thread(self._scorer, path or str(self.default_path))
            seqs = []
            for i, s in enumerate(request.sequences):
                ids = list(s.token_ids)
                if not 0 < s.prompt_length < len(ids):
                    raise invalid_argument(f"sequences[{i}].prompt_length",
                                           f"must be in 1..{len(ids) - 1} (sequence of {len(ids)} tokens)")
                if len(ids) > scorer.max_len:
                    raise invalid_argument(f"sequences[{i}].token_ids",
                                           f"{len(ids)} tokens exceed the model length {scorer.max_len}")
                if any(not 0 <= t < scorer.vocab_size for t in ids):
                    raise invalid_argument(f"sequences[{i}].token_ids", f"ids outside the vocabulary "
                                                                        f"(size {scorer.vocab_size})")
                seqs.append(Sequence(ids, s.prompt_length))
            t0 = time.perf_counter()
            lps = await asyncio.to_thread(scorer.logprobs, seqs)
            compute = time.perf_counter() - t0
        return reference_pb2.LogProbsResponse(
            sequences=[reference_pb2.SequenceLogProbs(logprobs=lp) for lp in lps], model=scorer.model_path,
            compute_seconds=compute)


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.reference.app:build`)."""
    return build_app(Reference, ReferenceArgs, args)

