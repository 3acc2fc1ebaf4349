"""DAPO's overlong reward shaping: a soft length penalty before the generation cap.

DAPO (Yu et al. 2025, arXiv:2503.14476, section 3.4, eq. 13): with L_max the
response cap and L_cache the buffer before it, a response of |y| tokens gets

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                  ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                  -1                                 if L_max < |y|

added to its task reward, here scaled by `overlong_buffer_penalty` (verl's
`penalty_factor`, NeMo-RL's key). Truncated responses are then not punished
as hard as wrong ones, and the penalty grows smoothly instead of jumping at
the cap, which the paper finds reduces reward noise.
"""

from __future__ import annotations

from torch import Tensor


def overlong_penalty(lengths: Tensor, max_response_length: int, buffer_length: int, penalty: float) -> Tensor:
    """R_length for completion lengths (any shape): 0 down to -penalty over the buffer, -penalty past it."""
    exceed = lengths.float() - (max_response_length - buffer_length)
    return -penalty * (exceed / buffer_length).clamp(0.0, 1.0)
