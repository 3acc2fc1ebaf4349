"""Rollout engines by name: the rollout service's `args.engine`.

The names and where each engine lives are the catalog's (`rlserve.catalog.ROLLOUT_ENGINES`, open to
plug-ins): an entry is a callable (EngineConfig) -> RolloutEngine, imported when the engine is built.
"""

from __future__ import annotations

import logging

from rlserve.catalog import ROLLOUT_ENGINES
from rlserve.rollout.interfaces import EngineConfig, RolloutEngine

log = logging.getLogger("rlserve.rollout")


def make_engine(name: str, cfg: EngineConfig) -> RolloutEngine:
    """The engine registered as `name` on `cfg` (ValueError listing the valid names if unknown)."""
    return ROLLOUT_ENGINES.load(name)(cfg)


def transformers_engine(cfg: EngineConfig) -> RolloutEngine:
    """`engine: transformers`: the transformers batch engine, served one call at a time."""
    from rlserve.rollout.hf_engine import TransformersEngine
    from rlserve.rollout.serialized import Serialized

    return Serialized(TransformersEngine(cfg))


def vllm_missing(device: str) -> str | None:
    """Why vLLM cannot generate on `device` ("cuda", "cpu"; "auto": CUDA when this process sees a GPU) in this
    environment, or None when it can: not installed, not importable (a build for another torch), or built for
    another device (vLLM's CPU build on a GPU)."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ModuleNotFoundError as err:
        if err.name == "vllm" or err.name is None:
            return "vLLM is not installed here"
        return f"vLLM does not import here ({type(err).__name__}: {err})"[:400]
    except Exception as err:  # noqa: BLE001 - a build for another torch or CUDA (ImportError, OSError, RuntimeError)
        return f"vLLM does not import here ({type(err).__name__}: {err})"[:400]
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    built_for = "cuda" if current_platform.is_cuda() else current_platform.device_type or "cpu"
    if built_for != device:
        return f"vLLM {vllm.__version__} is installed for {built_for}, and this replica generates on {device}"
    return None


def auto_engine(cfg: EngineConfig) -> RolloutEngine:
    """`engine: auto`: vLLM where it can generate on this replica's device, else the transformers engine, and
    a warning that says why (the cluster file's GPU examples use it: the lent GPUs have no vLLM build)."""
    reason = vllm_missing(cfg.device)
    if reason is None:
        from rlserve.rollout.vllm_engine import VllmEngine

        log.info("rollout: engine auto: vLLM generates")
        return VllmEngine(cfg)
    log.warning("rollout: engine auto: %s; the transformers engine generates instead (`pip install .[gpu]` "
                "installs vLLM: docs/gpus.md)", reason)
    return transformers_engine(cfg)
