"""GPU memory a user can plan: the services' declared needs against the card, checked before `up` starts anything.

Each service may declare the GPU memory one replica uses at its peak (`services.<name>.gpu_memory_gib`,
the CUDA context and the allocator's reserve included). Which replicas share a GPU is Ray's choice, within
the fractions they ask for (`num_gpus`):

- a replica that asks for whole GPUs (num_gpus >= 1) holds them alone: its need must fit one card;
- replicas that ask for fractions may land on one GPU together whenever their fractions add up to at
  most 1; the check takes the set of them that fits on one GPU and needs the most memory;
- the learner's workers take their share of a GPU from each run's spec (`cluster.gpus_per_worker`), not
  from the cluster file: their declared need counts on every GPU, beside any such set.

A layout whose worst GPU needs more than the card holds is refused, naming the services on it. The card's
memory is the cluster file's `gpu_card_gib`, or else read from this machine's smallest GPU
(`torch.cuda.get_device_properties`, in a child process, so that `deploy/serve` holds no CUDA context).

A rollout that may run vLLM (`engine: vllm`, or `auto`, which picks it where it runs) takes its
`gpu_memory_utilization` of the card whatever it declares: the check counts the larger of the two.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import dataclass, replace

from rlserve.cluster.config import ClusterFile

# Services whose GPUs come with each run, not with their replicas' num_gpus.
_PER_RUN_GPUS = ("learner",)
# Replicas of fractional services the exact search looks at; past this the check counts them all (safe side).
_MAX_EXACT = 16
_PROBE = ("import json, torch\n"
          "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
          "props = [torch.cuda.get_device_properties(i) for i in range(n)]\n"
          "print(json.dumps([[p.name, p.total_memory] for p in props]))\n")


class GpuLayoutError(ValueError):
    """The declared needs of services that may share a GPU exceed the card."""


@dataclass(frozen=True)
class Card:
    gib: float
    name: str  # where the size came from: the GPU's name, or the cluster file's key


@dataclass(frozen=True)
class Need:
    service: str
    gib: float        # per replica, on each GPU it uses
    num_gpus: float   # per replica; 0 for the learner (its workers' share comes with each run)
    replicas: int


def declared(cfg: ClusterFile) -> tuple[list[Need], list[str]]:
    """(the services that declare gpu_memory_gib, the GPU services that do not)."""
    needs, undeclared = [], []
    for name in type(cfg.services).model_fields:
        svc = getattr(cfg.services, name)
        if svc.gpu_memory_gib is not None:
            needs.append(Need(name, svc.gpu_memory_gib, 0.0 if name in _PER_RUN_GPUS else svc.num_gpus, svc.replicas))
        elif svc.num_gpus > 0:
            undeclared.append(name)
    return needs, undeclared


def worst_gpu(needs: list[Need]) -> tuple[float, list[str]]:
    """The most memory one GPU may have to hold and the replicas on it (module docstring), e.g.
    (76.0, ["rollout", "reference", "learner"])."""
    everywhere = [n for n in needs if n.num_gpus == 0]  # the learner: its workers may be on any GPU
    alone = [(n.gib, [n.service]) for n in needs if n.num_gpus >= 1]
    shared = [n for n in needs if 0 < n.num_gpus < 1 for _ in range(n.replicas)]
    base = sum(n.gib for n in everywhere)
    groups: list[tuple[Need, ...]] = [tuple(shared)]  # too many to search: all of them together (the safe side)
    if len(shared) <= _MAX_EXACT:
        groups = [g for k in range(len(shared) + 1) for g in itertools.combinations(shared, k)
                  if sum(n.num_gpus for n in g) <= 1 + 1e-9]
    group = max(groups, key=lambda g: sum(n.gib for n in g))
    best = (base + sum(n.gib for n in group), [n.service for n in group] + [n.service for n in everywhere])
    return max([best, *alone], key=lambda t: t[0])


def read_card() -> Card | None:
    """This machine's smallest GPU (torch in a child process), or None without one."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
        cards = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None
    if not cards:
        return None
    name, total = min(cards, key=lambda c: c[1])
    return Card(total / 2**30, name)


def check(cfg: ClusterFile, card: Card | None = None) -> list[str]:
    """Lines for the operator about the plan; raises GpuLayoutError when the worst GPU's needs exceed the card.
    `card`: the card's size (a test gives it); None: the cluster file's `gpu_card_gib`, else this machine's GPU.
    Reads no GPU when no service declares a need."""
    needs, undeclared = declared(cfg)
    if not needs:
        return [f"GPU memory not declared for {', '.join(undeclared)} (services.<name>.gpu_memory_gib): "
                "not checked against the card"] if undeclared else []
    if card is None:
        card = Card(cfg.gpu_card_gib, "gpu_card_gib") if cfg.gpu_card_gib is not None else read_card()
    if card is None:
        return ["no GPU on this machine to read the card's memory from, and no gpu_card_gib in the cluster file: "
                "the services' gpu_memory_gib are not checked"]
    needs = [_with_vllm_share(cfg, n, card) for n in needs]
    gib, services = worst_gpu(needs)
    parts = " + ".join(f"{s} {_need_of(needs, s):g}" for s in services)
    if gib > card.gib:
        raise GpuLayoutError(
            f"the services' declared GPU memory does not fit one GPU: {parts} = {gib:g} GiB may share one GPU, "
            f"which holds {card.gib:.1f} GiB ({card.name}). Lower their services.<name>.gpu_memory_gib (and what "
            f"they use: the runs' batch sizes, the rollout's max_model_len, the reference's token_budget), or give "
            f"them GPUs of their own (num_gpus); nothing was started")
    lines = [f"GPU memory plan: {parts} = {gib:g} of {card.gib:.1f} GiB on one GPU ({card.name})"]
    if undeclared:
        lines.append(f"GPU memory not declared for {', '.join(undeclared)}: not in the plan")
    return lines


def _with_vllm_share(cfg: ClusterFile, need: Need, card: Card) -> Need:
    """The rollout's need, at least the share of the card vLLM takes where it may run vLLM."""
    args = cfg.services.rollout.args
    # Without `engine`, the rollout runs vLLM (RolloutArgs.engine, services/rollout/app.py).
    if need.service != "rollout" or args.get("engine", "vllm") not in ("vllm", "auto"):
        return need
    share = args.get("gpu_memory_utilization")
    if share is None:  # the engine's default (a torch import, only for such a file)
        from rlserve.rollout.interfaces import EngineSettings

        share = EngineSettings.model_fields["gpu_memory_utilization"].default
    return replace(need, gib=max(need.gib, round(share * card.gib, 1)))


def _need_of(needs: list[Need], service: str) -> float:
    return next(n.gib for n in needs if n.service == service)
