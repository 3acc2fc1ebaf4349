"""What a loss and an advantage estimator are, for the learner's objective and the coordinator.

Implementations live in `losses/` and `advantages/`, one module each (or in a
plug-in package), and are chosen by name through `rlserve.algorithms.registry`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from rlserve.config.algorithms import AdvEstimatorCfg, DpoCfg, LossFnCfg


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's completion tokens as flat [N] vectors (layout: `rlserve.algorithms.losses`).

    curr: the policy being trained (with grad); prev: the same policy at the
    start of the step (the PPO "old" policy); gen: the generator that sampled
    the tokens; ref: the frozen reference. A logprob a loss does not declare a
    need for may be None.
    """

    curr_logprobs: Tensor
    prev_logprobs: Tensor | None
    gen_logprobs: Tensor | None
    ref_logprobs: Tensor | None
    advantages: Tensor
    mask: Tensor
    seq_index: Tensor
    num_seqs: int


class Loss(ABC):
    """A training loss, built from the run's `loss_fn` section, that declares what a step must bring it.

    The step (`rlserve.training.objective.StepObjective`) reads the
    declarations instead of knowing losses by name.
    """

    # The batch must carry the generator's logprobs.
    needs_generator_logprobs: ClassVar[bool]
    # The loss takes a ratio to the policy at the start of the step: a step of several optimizer
    # updates computes those logprobs before the first one.
    needs_prev_logprobs: ClassVar[bool]
    # The step is cut into optimizer updates of `policy.train_global_batch_size` sequences
    # (otherwise the whole batch is one update).
    minibatched: ClassVar[bool]
    # Sequences 2k and 2k + 1 form a pair (DPO's chosen and rejected) that a micro-batch holds whole.
    paired: ClassVar[bool] = False
    # Metrics of this loss beyond the shared ones (`rlserve.algorithms.metrics`): metric name -> the key of
    # a sum it returns, reported as is (a plug-in loss's own, e.g. {"my_loss/term": "my_term_sum"}).
    reported_sums: ClassVar[Mapping[str, str]] = {}
    # Set by every constructor: the reference policy's logprobs are used.
    needs_reference_logprobs: bool
    # Set by every constructor: the global normaliser counts valid tokens (True) or sequences.
    token_level: bool

    @abstractmethod
    def __init__(self, cfg: LossFnCfg | DpoCfg) -> None: ...

    @abstractmethod
    def __call__(self, inputs: LossInputs, global_normalizer: Tensor | float) -> tuple[Tensor, dict[str, Tensor]]:
        """(this micro-batch's share of the step loss, its metric sums; see `rlserve.algorithms.metrics`)."""


@dataclass(frozen=True)
class AdvantageInputs:
    """One step's trainable groups (a group: the samples of one prompt).

    rewards [G, n]; per completion token, padded to the step's longest completion [G, n, T]: mask
    (the completion's tokens), the generator's logprobs, and the reference policy's (None unless
    the estimator needs them; 0 where mask is False).
    """

    rewards: Tensor
    mask: Tensor
    gen_logprobs: Tensor
    ref_logprobs: Tensor | None


class AdvantageEstimator(ABC):
    """Turns a step's rewards into advantages, built from `grpo.adv_estimator` (and `loss_fn`, whose KL
    penalty an estimator may put into the reward)."""

    # Advantages per token [G, n, T] (True) or one per sample [G, n] (False).
    token_level: ClassVar[bool]
    # Each sample's advantage is relative to its group's rewards alone, so a group whose samples scored
    # alike gets zero advantages and carries no signal (`grpo.skip_zero_advantage_groups` drops it).
    # False: a tied group's advantages are not zero (REINFORCE++ normalises over the whole batch, a
    # distillation teacher scores every token), and the group trains.
    group_relative: ClassVar[bool] = True
    # Set by every constructor: the reference policy's logprobs are read.
    needs_reference_logprobs: bool

    @abstractmethod
    def __init__(self, cfg: AdvEstimatorCfg, loss_cfg: LossFnCfg) -> None: ...

    @abstractmethod
    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        """Advantages [G, n] or, for a token-level estimator, [G, n, T] (0 where the mask is False)."""

    def metrics(self, inputs: AdvantageInputs) -> dict[str, float]:
        """What the estimator reports about a step (none by default)."""
        return {}
