"""The learner's primitives below a whole step: a loss on a batch of datums, its gradients accumulated
until an optimizer step the caller asks for (the Tinker SDK's `forward`, `forward_backward` and
`optim_step`; `rlserve.tinker` serves them).

A datum is one sequence: its input tokens, and per input position the target token that position
predicts (position i predicts target i: the SDK's alignment, so targets are usually the inputs shifted
by one) with the loss's per-token inputs (weights, advantages, the sampler's logprobs). Each loss is a
sum over the datum's tokens (never a mean), and a batch's loss the sum over its datums, as the SDK's
documentation writes every built-in (https://tinker-docs.thinkingmachines.ai/tinker/losses); `p` below
is the learner's logprob of the target, `q` the sampler's, `A` the advantage:

- cross_entropy:       -sum(w * p)                                       (w: `weights`, default 1)
- importance_sampling: -sum(exp(p - q) * A)
- ppo:                 -sum(min(r * A, clip(r, lo, hi) * A)),  r = exp(p - q)
- cispo:               -sum(sg(clip(r, lo, hi)) * p * A)
- dro:                 -sum(p * A - beta / 2 * (p - q)^2)
- gspo:                PPO's clipped surrogate on the sequence ratio s = exp(mean_m(p - q)) over the
                       `sequence_ratio_mask` m (GSPO-token, Zheng et al. 2025, arXiv:2507.18071: each
                       token's ratio is sg(s) * exp(p - sg(p)), so its gradient is s * grad p), summed over m
- stable_reinforce:    REINFORCE with a truncated importance weight against the sampler's own logprobs q
                       (recorded when it sampled, never the client's copy) and a k3 KL penalty to it:
                       -sum(sg(min(r, hi)) * p * A) + kl_coeff * sum(r^-1 - 1 + log r)  (r = exp(p - q)).
                       The SDK names this loss without publishing its formula; this is rlserve's.

`lo`/`hi` come from `loss_fn_config` (`clip_low_threshold`, `clip_high_threshold`) or per token from the
inputs of the same names; `beta` and `kl_coeff` from `loss_fn_config`. Every loss returns the learner's
logprobs of the targets per datum and the metric `loss:sum`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# The per-token inputs each loss needs and may take (beyond `target_tokens`), and its config keys with
# their defaults and bounds.
_RL = ("logprobs", "advantages")


@dataclass(frozen=True)
class ConfigKey:
    default: float
    low: float
    high: float


@dataclass(frozen=True)
class PrimitiveLoss:
    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    config: dict[str, ConfigKey]
    fn: Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]
    # stable_reinforce: q comes from what the sampler recorded (the server fills `logprobs` from it)
    needs_recorded_logprobs: bool = False


def _clip(inputs: dict[str, torch.Tensor], cfg: dict[str, float]) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    lo = inputs.get("clip_low_threshold", cfg["clip_low_threshold"])
    hi = inputs.get("clip_high_threshold", cfg["clip_high_threshold"])
    return lo, hi


def _cross_entropy(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    weights = x.get("weights")
    return -(p if weights is None else p * weights).sum()


def _importance_sampling(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    return -(torch.exp(p - x["logprobs"]) * x["advantages"]).sum()


def _ppo(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    ratio = torch.exp(p - x["logprobs"])
    lo, hi = _clip(x, cfg)
    advantages = x["advantages"]
    return -torch.min(ratio * advantages, torch.clamp(ratio, lo, hi) * advantages).sum()


def _cispo(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    lo, hi = _clip(x, cfg)
    clipped = torch.clamp(torch.exp(p - x["logprobs"]), lo, hi).detach()
    return -(clipped * p * x["advantages"]).sum()


def _dro(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    return -(p * x["advantages"] - 0.5 * cfg["beta"] * (p - x["logprobs"]) ** 2).sum()


def _gspo(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    mask = x.get("sequence_ratio_mask")
    mask = torch.ones_like(p) if mask is None else mask
    count = mask.sum().clamp(min=1.0)
    s = torch.exp(((p - x["logprobs"]) * mask).sum() / count)
    ratio = s.detach() * torch.exp(p - p.detach())
    lo, hi = _clip(x, cfg)
    advantages = x["advantages"]
    return -(torch.min(ratio * advantages, torch.clamp(ratio, lo, hi) * advantages) * mask).sum()


def _stable_reinforce(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    log_ratio = p - x["logprobs"]
    weight = torch.clamp(torch.exp(log_ratio), max=cfg["clip_high_threshold"]).detach()
    # k3 (Schulman's estimator) of KL(q || p) from the sampler's tokens: exp(-d) - 1 + d >= 0, d = p - q.
    k3 = torch.exp(-log_ratio) - 1 + log_ratio
    mask = (x["advantages"] != 0) | (x.get("weights", torch.ones_like(p)) != 0)
    return -(weight * p * x["advantages"]).sum() + cfg["kl_coeff"] * (k3 * mask).sum()


_CLIP = {"clip_low_threshold": ConfigKey(0.8, 0.0, 1.0), "clip_high_threshold": ConfigKey(1.2, 1.0, 1e6)}
LOSSES: dict[str, PrimitiveLoss] = {loss.name: loss for loss in (
    PrimitiveLoss("cross_entropy", (), ("weights",), {}, _cross_entropy),
    PrimitiveLoss("importance_sampling", _RL, ("weights",), {}, _importance_sampling),
    PrimitiveLoss("ppo", _RL, ("weights", "clip_low_threshold", "clip_high_threshold"), _CLIP, _ppo),
    PrimitiveLoss("cispo", _RL, ("weights", "clip_low_threshold", "clip_high_threshold"), _CLIP, _cispo),
    PrimitiveLoss("dro", _RL, ("weights",), {"beta": ConfigKey(0.05, 0.0, 1e6)}, _dro),
    # GSPO's own clip range (the paper's 3e-4 / 4e-4 around 1).
    PrimitiveLoss("gspo", _RL, ("weights", "sequence_ratio_mask", "clip_low_threshold", "clip_high_threshold"),
                  {"clip_low_threshold": ConfigKey(1 - 3e-4, 0.0, 1.0),
                   "clip_high_threshold": ConfigKey(1 + 4e-4, 1.0, 1e6)}, _gspo),
    PrimitiveLoss("stable_reinforce", ("advantages",), ("weights", "logprobs"),
                  {"kl_coeff": ConfigKey(0.0, 0.0, 1e6), "clip_high_threshold": ConfigKey(2.0, 1.0, 1e6)},
                  _stable_reinforce, needs_recorded_logprobs=True),
)}


def loss_config(loss: PrimitiveLoss, given: dict[str, float]) -> dict[str, float]:
    """The loss's config: `given` over its defaults; ValueError naming a key it lacks or a value out of range."""
    for key, value in given.items():
        spec = loss.config.get(key)
        if spec is None:
            known = ", ".join(sorted(loss.config)) or "none"
            raise ValueError(f"loss_fn_config.{key}: {loss.name} takes no such key (it takes: {known})")
        if not spec.low <= value <= spec.high:
            raise ValueError(f"loss_fn_config.{key}: {value} is outside [{spec.low}, {spec.high}]")
    return {key: given.get(key, spec.default) for key, spec in loss.config.items()}


@dataclass
class Datum:
    tokens: torch.Tensor  # [N] long: the model input
    targets: torch.Tensor  # [N] long: what each input position predicts
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # [N] float32 each


@dataclass
class DatumBatch:
    """What one `forward`/`forward_backward` call carries to the learner (every rank gets all of it)."""

    datums: list[Datum]
    loss: str
    config: dict[str, float]

    @property
    def num_tokens(self) -> int:
        return sum(int(d.tokens.numel()) for d in self.datums)


@dataclass(frozen=True)
class PrimitiveResult:
    logprobs: list[torch.Tensor]  # per datum, [N] float32 on the host
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdamStep:
    """One optimizer update with the SDK's AdamParams (decoupled weight decay, as torch's AdamW)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


def datum_loss(batch: DatumBatch, logprobs: list[torch.Tensor]) -> torch.Tensor:
    """The batch's loss from the learner's logprobs of each datum's targets (a sum over datums)."""
    loss = LOSSES[batch.loss]
    total = logprobs[0].new_zeros(())
    for datum, p in zip(batch.datums, logprobs):
        inputs = {k: v.to(p.device) for k, v in datum.inputs.items()}
        total = total + loss.fn(p, inputs, batch.config)
    return total
