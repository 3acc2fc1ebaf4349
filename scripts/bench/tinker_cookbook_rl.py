"""The tinker-cookbook's RL driver learning through an rlserve cluster's Tinker API (/api/v1): the cookbook's
`supervised.train` warms the cluster's model up on a local JSONL of addition conversations, then its
`rl.train` trains on the cookbook's arithmetic task (`recipes.math_rl.arithmetic_env`, no few-shot prefix)
from that state; held-out accuracy (greedy, 64 problems the training never saw) is measured on the SFT
state's sampler and on the RL run's final sampler, through the official SDK.

    flock /tmp/rlserve-integration.lock .venv/bin/python scripts/bench/tinker_cookbook_rl.py [--sft-steps 200]

brings up a local cluster of the test cluster's shape (tests/integration/cluster.yaml: the tiny preset on
vLLM CPU, LoRA up to `--rank`) and tears it down after; `--url URL --key tml-...` runs against a cluster that is up (its
deployed model named by `--model`, its folder by `--folder`). Prints one JSON line with the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tinker_cookbook import checkpoint_utils, renderers  # noqa: E402
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: E402

from rlserve.models import resolve_model  # noqa: E402
from rlserve.tinker.cookbook import RENDERER, register  # noqa: E402
from tests.support.tinker_cookbook_drivers import addition_jsonl, metrics, reinforce, supervised  # noqa: E402


def held_out(url: str, key: str, model: str, sampler_path: str, n: int = 64, seed: int = 12345) -> float:
    """Greedy accuracy on `n` problems of the arithmetic task (operands in [0, 100]) from another seed."""
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(model))
    client = tinker.ServiceClient(base_url=url, api_key=key)
    sampler = client.create_sampling_client(model_path=sampler_path).result()
    rng = random.Random(seed)
    problems = [(rng.randint(0, 100), rng.randint(0, 100)) for _ in range(n)]
    futures = [sampler.sample(renderer.build_generation_prompt([{"role": "user", "content": f"What is {x} + {y}?"}]),
                              1, types.SamplingParams(max_tokens=6, temperature=0.0,
                                                      stop=renderer.get_stop_sequences()))
               for x, y in problems]
    right = 0
    for (x, y), future in zip(problems, futures):
        message, _ = renderer.parse_response(future.result().sequences[0].tokens)
        right += ArithmeticEnv(x, y, renderer).check_answer(renderers.get_text_content(message))
    client.close("success").result()
    return right / n


def run(url: str, key: str, model: str, folder: Path, work: Path, args) -> dict:
    register(model, folder)
    t0 = time.perf_counter()
    data = addition_jsonl(work / "addition.jsonl", args.sft_steps * args.sft_batch)
    sl = metrics(supervised(url, key, model, folder, work / "sl", data, batch_size=args.sft_batch,
                            steps=args.sft_steps, learning_rate=args.sft_lr, lora_rank=args.rank))
    sft_s = time.perf_counter() - t0
    start = checkpoint_utils.get_last_checkpoint(str(work / "sl"))
    before = held_out(url, key, model, start.sampler_path)
    t1 = time.perf_counter()
    rl = metrics(reinforce(url, key, model, folder, work / "rl", batch_size=args.rl_batch, group_size=args.group,
                           steps=args.rl_steps, learning_rate=args.rl_lr, load_checkpoint_path=start.state_path,
                           lora_rank=args.rank))
    rl_s = time.perf_counter() - t1
    end = checkpoint_utils.get_last_checkpoint(str(work / "rl"), required_key="sampler_path")
    after = held_out(url, key, model, end.sampler_path)
    rewards = [m["env/all/reward/total"] for m in rl if "env/all/reward/total" in m]
    k = max(1, len(rewards) // 5)
    return {"model": model, "sft_steps": args.sft_steps, "sft_final_nll": sl[-1].get("train_mean_nll"),
            "rl_steps": len(rewards), "rl_batch": args.rl_batch, "group_size": args.group,
            "train_reward_first_fifth": sum(rewards[:k]) / k, "train_reward_last_fifth": sum(rewards[-k:]) / k,
            "held_out_accuracy_sft": before, "held_out_accuracy_rl": after, "gain": after - before,
            "sft_seconds": round(sft_s, 1), "rl_seconds": round(rl_s, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url")
    p.add_argument("--key")
    p.add_argument("--model", default="rlserve/tiny")
    p.add_argument("--folder", default="preset:tiny")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--sft-steps", type=int, default=200)
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--sft-lr", type=float, default=5e-3)
    p.add_argument("--rl-steps", type=int, default=40)
    p.add_argument("--rl-batch", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rl-lr", type=float, default=2e-3)
    args = p.parse_args()
    folder = resolve_model(args.folder)
    with tempfile.TemporaryDirectory(prefix="tinker-cookbook-rl-") as tmp:
        work = Path(tmp)
        if args.url:
            out = run(args.url, args.key, args.model, folder, work, args)
        else:
            import yaml

            from rlserve.security.users import add_user
            from tests.integration.conftest import HERE, running_cluster

            (work / "cluster").mkdir()
            data = yaml.safe_load((HERE / "cluster.yaml").read_text())
            data["services"]["rollout"]["args"]["max_lora_rank"] = max(args.rank, 16)
            (work / "cluster.yaml").write_text(yaml.safe_dump(data))
            with running_cluster(work / "cluster.yaml", work / "cluster") as tc:
                key = add_user(tc.cluster.users_file, "cookbook", admin=False, tinker=True)
                out = run(tc.cluster.http_url, key, args.model, folder, work, args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
