"""Generation engines behind one contract (`interfaces`): vLLM and transformers.

`follower.py` is a replica's side of weight sync (direct transfers from the learner,
catch-up from the weight store).
"""

from rlserve.rollout.registry import ENGINES, make_engine

__all__ = ["ENGINES", "make_engine"]
