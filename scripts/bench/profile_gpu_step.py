"""Where a learner step's GPU time goes: torch.profiler over a few steps of one backend (or the
plain transformers loop), top CUDA kernels by total time. Companion of learner_gpu.py.

    python scripts/bench/profile_gpu_step.py --backend dtensor --preset 1b
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "libs"), str(ROOT / "scripts" / "bench")]

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="dtensor", choices=["dtensor", "megatron", "plain"])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rows", type=int, default=18)
    args = parser.parse_args()

    from learner_gpu import batch_tokens, model_folder

    from rlserve.training.distributed import init_process_group

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    init_process_group(0, 1, f"file://{tempfile.mktemp()}", torch.device("cuda", 0))
    path = model_folder(args.preset)
    from transformers import AutoConfig

    ids = batch_tokens(args.batch, args.seq, AutoConfig.from_pretrained(path).vocab_size)
    if args.backend == "plain":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        cuda_ids = ids.cuda()

        def step():
            model(input_ids=cuda_ids, labels=cuda_ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        from rlserve.config import parse_spec
        from rlserve.training.batch import TrainBatch
        from services.learner.backends import make_backend

        policy = {"precision": "bfloat16", "max_total_sequence_length": args.seq, "train_micro_batch_size": args.batch,
                  "generation": {"max_new_tokens": 16}}
        if args.backend == "megatron":
            policy["megatron_cfg"] = {"enabled": True}
        backend = make_backend(parse_spec({"policy": policy, "cluster": {"device": "cuda"}}), path,
                               torch.device("cuda", 0))
        batch = TrainBatch.from_sequences(ids.tolist(), [1] * args.batch)

        def step():
            backend.train_step(batch, "sft", 1e-5)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
