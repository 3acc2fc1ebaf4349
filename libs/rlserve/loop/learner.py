"""The one place a run configures its learner session.

Every start of a session goes through here: a fresh run, a restore from a checkpoint, and an RL run's
SFT warm start (which trains every weight, so it passes a spec without LoRA). The spec travels as the
object the run holds; the learner does not parse it again.
"""

from __future__ import annotations

from pathlib import Path

from rlserve.config import RunSpec
from rlserve.loop.inputs import RunInputs
from rlserve.loop.services import RunServices
from rlserve.v1 import learner_pb2


async def configure_learner(services: RunServices, inputs: RunInputs, init_model: Path,
                            spec: RunSpec | None = None) -> learner_pb2.ConfigureResponse:
    """A new training session for the run on `init_model` (an HF folder, or a LoRA run's adapter folder for
    its base), as `spec` (default: the run's) configures it; any earlier session of the run ends."""
    spec = spec or inputs.spec
    return await services.configure(learner_pb2.ConfigureRequest(
        run_id=inputs.run_id, init_model_path=str(init_model), shared_base=spec.shares_deployed_base), spec)
