"""guess_number with a fixed latency per Reset and Step: an environment that waits on something (a tool,
a simulator, a remote API), for scripts/bench/multiturn_latency.py."""

from __future__ import annotations

import time

from rlserve.environments.builtins import GuessNumber
from rlserve.environments.interfaces import Episode, ResetOutput, StepInput, StepOutput


class SlowGuessNumber(GuessNumber):
    def __init__(self, latency_s: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.latency_s = float(latency_s)

    def reset(self, episode: Episode) -> ResetOutput:
        time.sleep(self.latency_s)
        return super().reset(episode)

    def step(self, step: StepInput) -> StepOutput:
        time.sleep(self.latency_s)
        return super().step(step)
