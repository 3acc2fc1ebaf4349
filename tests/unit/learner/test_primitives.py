"""The learner's primitives (forward, forward_backward, optim_step) on the session table over an in-process
worker group: the tiny model on CPU, no Ray. Gradients add up across forward_backward calls until an
optim_step, and a forward_backward of two halves is one of the whole."""

from __future__ import annotations

import asyncio

import torch
from torch.distributed.tensor import DTensor

from rlserve.config import RunSpec, parse_spec
from rlserve.learner.in_process_group import InProcessWorkerGroup
from rlserve.learner.sessions import SessionTable
from rlserve.training.primitives import AdamStep, Datum, DatumBatch


def spec() -> RunSpec:
    return parse_spec({"policy": {"model_name": "preset:tiny",
                                  "dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": 4, "alpha": 32}},
                                  "train_micro_batch_size": 2, "max_total_sequence_length": 64},
                       "cluster": {"device": "cpu"}})


def datums(seed: int, n: int = 3) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        tokens = torch.randint(3, 60, (6 + k,), generator=g)
        targets = torch.randint(3, 60, (6 + k,), generator=g)
        out.append(Datum(tokens, targets, {"weights": torch.rand(6 + k, generator=g)}))
    return out


def grads(table: SessionTable, run_id: str) -> dict[str, torch.Tensor]:
    backend = table.sessions[run_id].group.workers.host.runs[run_id].backend
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in backend.model.named_parameters() if p.grad is not None}


def test_forward_backward_accumulates_until_optim_step_and_forward_leaves_gradients_alone(model, publishing):
    async def main():
        table = SessionTable(InProcessWorkerGroup.starter(publishing))
        await table.configure("t", spec(), model, None, shared_base=True)
        data = datums(0)
        whole = await table.forward_primitive("t", DatumBatch(data, "cross_entropy", {}), backward=True)
        g_whole = grads(table, "t")
        # The loss is -sum(w * p) over every token of every datum, from the logprobs it returns.
        expected = -sum(float((lp * d.inputs["weights"]).sum()) for lp, d in zip(whole.logprobs, data))
        assert abs(whole.metrics["loss:sum"] - expected) < 1e-4
        assert [lp.shape[0] for lp in whole.logprobs] == [6, 7, 8]

        await table.configure("t", spec(), model, None, shared_base=True)  # fresh state, same seed
        first = await table.forward_primitive("t", DatumBatch(data[:1], "cross_entropy", {}), backward=True)
        await table.forward_primitive("t", DatumBatch(data, "cross_entropy", {}), backward=False)
        await table.forward_primitive("t", DatumBatch(data[1:], "cross_entropy", {}), backward=True)
        g_halves = grads(table, "t")
        assert torch.allclose(first.logprobs[0], whole.logprobs[0], atol=1e-6)
        assert g_whole.keys() == g_halves.keys() and g_whole
        for name in g_whole:
            assert torch.allclose(g_whole[name], g_halves[name], atol=1e-6), name

        step = await table.optim_step("t", AdamStep(learning_rate=1e-2))
        assert step.version == 1 and table.sessions["t"].version == 1
        assert grads(table, "t") == {}  # cleared
        after = await table.forward_primitive("t", DatumBatch(data, "cross_entropy", {}), backward=False)
        assert after.metrics["loss:sum"] < whole.metrics["loss:sum"]
        await table.release("t")

    asyncio.run(main())
