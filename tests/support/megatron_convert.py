"""Whole-model HF <-> Megatron conversion for tests: every rank's shard in one process.

The product path converts one parameter at a time (`rlserve.learner.megatron.hf_map.megatron_param_to_hf`,
driven by the megatron backend's exporter); these helpers assemble a whole model from
per-rank state dicts, which only tests can afford.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from torch import Tensor

from rlserve.learner.megatron.hf_map import (
    _expert_placement,
    _from_shards,
    _global_rule_index,
    _is_moe,
    _own,
    _rules,
)


def _shard_ranks(n_shards: int, tp_size: int, ep_size: int, etp_size: int,
                 ranks: Sequence[tuple[int, int, int]] | None) -> list[tuple[int, int, int]]:
    if ranks is not None:
        if len(ranks) != n_shards:
            raise ValueError(f"{n_shards} shards but {len(ranks)} rank coordinates")
        return list(ranks)
    if etp_size != tp_size or n_shards != tp_size * ep_size:
        raise ValueError(
            f"pass ranks=[(tp_rank, ep_rank, etp_rank), ...] unless there is one shard per (ep, tp) pair "
            f"with ETP == TP; got {n_shards} shards for tp={tp_size} ep={ep_size} etp={etp_size}"
        )
    return [(r % tp_size, r // tp_size, r % tp_size) for r in range(n_shards)]


def iter_megatron_to_hf(
    shards: Sequence[Mapping[str, Tensor]],
    hf_config,
    tp_size: int,
    ep_size: int = 1,
    *,
    etp_size: int | None = None,
    ranks: Sequence[tuple[int, int, int]] | None = None,
    use_te: bool = False,
    moe_grouped_gemm: bool = False,
) -> Iterator[tuple[str, Tensor]]:
    """Yield `(hf_name, full tensor)` one HF parameter at a time, in model order (embedding, layers, norm, head).

    `shards` are GPTModel state dicts (whole model, one per rank). By default
    `shards[ep_rank * tp_size + tp_rank]` (megatron's rank order when ETP ==
    TP); otherwise give `ranks[i] = (tp_rank, ep_rank, etp_rank)` for each
    shard. Only the tensors of the parameter being yielded are materialised,
    so an exporter can bucket them without a second copy of the model.
    `_extra_state` entries are ignored; other unknown names raise.
    """
    etp_size = tp_size if etp_size is None else etp_size
    coords = _shard_ranks(len(shards), tp_size, ep_size, etp_size, ranks)
    index = _global_rule_index(hf_config, use_te, moe_grouped_gemm, ep_size)
    for shard, (_, ep_rank, _) in zip(shards, coords):
        unknown = [k for k in shard if not k.endswith("._extra_state") and (k, ep_rank) not in index]
        if unknown:
            raise KeyError(f"not {hf_config.model_type} GPTModel parameters: {unknown[:8]}")
    local = _expert_placement(hf_config, ep_size) if _is_moe(hf_config) else 0

    for rule in _rules(hf_config, use_te, moe_grouped_gemm):
        if rule.expert is None:
            name, group_size = rule.mcore, tp_size
            members = {tp: shard for shard, (tp, _, _) in zip(shards, coords)}
        else:
            name, group_size = rule.mcore.format(j=rule.expert % local), etp_size
            members = {etp: shard for shard, (_, ep, etp) in zip(shards, coords) if ep == rule.expert // local}
        try:
            pieces = [members[r][name] for r in range(group_size)]
        except KeyError as exc:
            raise KeyError(f"{name}: no shard for TP/ETP rank {exc.args[0]!r} (or the name is missing)") from None
        for hf_name, tensor in zip(rule.hf, _from_shards(rule, pieces, hf_config)):
            yield hf_name, _own(tensor)


def megatron_to_hf(
    shards: Sequence[Mapping[str, Tensor]],
    hf_config,
    tp_size: int,
    ep_size: int = 1,
    *,
    etp_size: int | None = None,
    ranks: Sequence[tuple[int, int, int]] | None = None,
    use_te: bool = False,
    moe_grouped_gemm: bool = False,
) -> dict[str, Tensor]:
    """All HF checkpoint-named full tensors from the shards of every rank (see `iter_megatron_to_hf`)."""
    return dict(iter_megatron_to_hf(shards, hf_config, tp_size, ep_size, etp_size=etp_size, ranks=ranks,
                                    use_te=use_te, moe_grouped_gemm=moe_grouped_gemm))
