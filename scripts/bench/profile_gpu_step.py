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

    from learner_gpu import backend_step, batch_tokens, model_folder, plain_step

    from rlserve.training.distributed import init_process_group

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    init_process_group(0, 1, f"file://{tempfile.mktemp()}", torch.device("cuda", 0))
    path = model_folder(args.preset)
    from transformers import AutoConfig

    ids = batch_tokens(args.batch, args.seq, AutoConfig.from_pretrained(path).vocab_size)
    if args.backend == "plain":
        step = plain_step(path, ids, read_loss=True, micro_batch=args.batch)
    else:
        step, _ = backend_step(args.backend, path, ids, args.batch)
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
