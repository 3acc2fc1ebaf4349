"""Losses and advantage estimators by name: `loss_fn.name` and `grpo.adv_estimator.name`.

The names and where each one's class lives are the catalog's (`rlserve.catalog.LOSSES`,
`ADVANTAGE_ESTIMATORS`, open to plug-ins); a class is imported when first used, so
the spec validates names without loading torch. Adding a loss is its module under
`losses/` (a `Loss`, see `rlserve.algorithms.interfaces`), its line in the catalog
and its test; an advantage estimator likewise under `advantages/`.
(verl's `register_policy_loss` / `register_adv_est` registries, made lazy.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlserve.catalog import ADVANTAGE_ESTIMATORS, LOSSES

if TYPE_CHECKING:
    from rlserve.algorithms.interfaces import AdvantageEstimator, Loss
    from rlserve.config.algorithms import AdvEstimatorCfg, DpoCfg, LossFnCfg
    from rlserve.config.spec import RunSpec

# The spec section a loss is configured by, where it is not `loss_fn`.
LOSS_SECTIONS = {"dpo": "dpo"}


def make_loss(name: str, cfg: LossFnCfg | DpoCfg) -> Loss:
    """The loss registered as `name`, configured by `cfg` (its section of the spec; ValueError if unknown)."""
    return LOSSES.load(name)(cfg)


def loss_for_run(name: str, spec: RunSpec) -> Loss:
    """The loss `name` configured by its section of the run's spec (`loss_fn`, or `LOSS_SECTIONS`)."""
    return make_loss(name, getattr(spec, LOSS_SECTIONS.get(name, "loss_fn")))


def advantage_estimator(cfg: AdvEstimatorCfg, loss_cfg: LossFnCfg) -> AdvantageEstimator:
    """The estimator `cfg.name` names, configured by `cfg` and the run's `loss_fn` (ValueError if unknown)."""
    return ADVANTAGE_ESTIMATORS.load(cfg.name)(cfg, loss_cfg)
