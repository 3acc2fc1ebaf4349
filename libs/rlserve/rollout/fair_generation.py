"""An engine's generation shared between runs in proportion to their priorities, counted in tokens.

In front of the engine's own scheduler (vLLM's is first come, first served),
each request waits for its run's turn (`rlserve.tenancy.fair_share`, capacity:
the sequences the engine runs at once). It is charged its prompt tokens and
the tokens it generates, so a run whose completions are 10x longer gets the
same tokens as the others, not 10x the engine. A run alone is never held.
"""

from __future__ import annotations

from rlserve.rollout.interfaces import GeneratedSample, RolloutEngine, RunAdapter, SamplingSpec
from rlserve.tenancy.fair_share import FairShare


class FairGeneration:
    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.share = FairShare(engine.max_running_sequences)

    async def generate(self, run_id: str, priority: float, prompts: list[list[int]], n: int, sampling: SamplingSpec,
                       adapter: RunAdapter | None = None) -> list[list[GeneratedSample]]:
        """`engine.generate` in the run's turn; while it runs it is charged n x max_new_tokens per prompt."""
        prompt_tokens = sum(len(p) for p in prompts)
        units = len(prompts) * n
        turn = await self.share.acquire(run_id, priority, units, prompt_tokens + units * sampling.max_new_tokens)
        used = prompt_tokens
        try:
            outputs = await self.engine.generate(prompts, n, sampling, adapter)
            used += sum(len(s.token_ids) for samples in outputs for s in samples)
            return outputs
        finally:
            self.share.release(turn, used)
