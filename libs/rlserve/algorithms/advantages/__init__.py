"""Advantage estimators, one module each, chosen by `grpo.adv_estimator.name` (`rlserve.algorithms.registry`)."""
