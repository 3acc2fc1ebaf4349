"""On-policy distillation (Agarwal et al. 2024, arXiv:2306.13649; Thinking Machines' "On-Policy
Distillation", 2025): GRPO's loop, where the reference service scores the student's own samples with a
teacher (`teacher.model_name`) and each token's advantage pulls toward the teacher
(`advantages/distillation.py`, `grpo.adv_estimator.name: on_policy_distillation`). Groups whose rewards
tie still carry the teacher's signal, so none is dropped for it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rlserve.algorithms.grpo import Grpo
from rlserve.models import resolve_model


class Distillation(Grpo):
    async def reference_model(self) -> Path:
        """The teacher (a preset is generated off the event loop the first time)."""
        teacher = self.attempt.inputs.spec.teacher
        return await asyncio.to_thread(resolve_model, teacher.model_name, teacher.model_seed)
