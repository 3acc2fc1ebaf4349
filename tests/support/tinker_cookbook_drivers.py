"""The `tinker-cookbook`'s own training drivers against a Tinker endpoint, on a model of the cluster:
`tinker_cookbook.supervised.train` on a local JSONL chat dataset (the cookbook's `FromConversationFileBuilder`)
of addition problems, and `tinker_cookbook.rl.train` on the cookbook's built-in arithmetic task
(`recipes.math_rl.arithmetic_env`), with the model's tokenizer and renderer in the cookbook's registries
(`rlserve.tinker.cookbook`). Used by tests/integration/test_tinker_cookbook.py (a few steps) and
scripts/bench/tinker_cookbook_rl.py (to learning).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

from rlserve.tinker.cookbook import RENDERER, register


def addition_jsonl(path: Path, n: int, seed: int = 0) -> Path:
    """`n` conversations "what is x + y?" -> "x+y", as the arithmetic task asks them (operands in [0, 100])."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            x, y = rng.randint(0, 100), rng.randint(0, 100)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {x} + {y}?"},
                                             {"role": "assistant", "content": str(x + y)}]}) + "\n")
    return path


def _env(url: str, key: str) -> None:
    os.environ["TINKER_API_KEY"] = key  # what the drivers' ServiceClient reads
    os.environ.setdefault("TINKER_TELEMETRY", "0")


def supervised(url: str, key: str, model: str, folder: Path, log_path: Path, data: Path, *, batch_size: int,
               steps: int, learning_rate: float, lora_rank: int = 8) -> Path:
    """`tinker_cookbook.supervised.train.main` for `steps` batches; returns its metrics file."""
    register(model, folder)
    _env(url, key)
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name=RENDERER, max_length=64,
                                            batch_size=batch_size)
    config = sl_train.Config(log_path=str(log_path), model_name=model, recipe_name="rlserve_test_sl",
                             renderer_name=RENDERER, base_url=url, learning_rate=learning_rate,
                             lr_schedule="constant", lora_rank=lora_rank, max_steps=steps, save_every=0,
                             eval_every=0, infrequent_eval_every=0, ttl_seconds=3600,
                             dataset_builder=FromConversationFileBuilder(file_path=str(data), common_config=common))
    asyncio.run(sl_train.main(config))
    return log_path / "metrics.jsonl"


def reinforce(url: str, key: str, model: str, folder: Path, log_path: Path, *, batch_size: int, group_size: int,
              steps: int, learning_rate: float, load_checkpoint_path: str | None = None, lora_rank: int = 8,
              loss_fn: str = "importance_sampling") -> Path:
    """`tinker_cookbook.rl.train.main` on the arithmetic task for `steps` batches (from `load_checkpoint_path`, a
    `tinker://` state, if given); returns its metrics file."""
    register(model, folder)
    _env(url, key)
    dataset = ArithmeticDatasetBuilder(batch_size=batch_size, model_name_for_tokenizer=model, renderer_name=RENDERER,
                                       n_batches=steps, group_size=group_size, include_fewshot=False)
    config = rl_train.Config(log_path=str(log_path), model_name=model, recipe_name="rlserve_test_rl",
                             renderer_name=RENDERER, base_url=url, learning_rate=learning_rate, max_tokens=6,
                             dataset_builder=dataset, lora_rank=lora_rank, loss_fn=loss_fn, eval_every=0,
                             save_every=0, ttl_seconds=3600, load_checkpoint_path=load_checkpoint_path,
                             max_steps=steps, rollout_json_export=False, num_groups_to_log=0)
    asyncio.run(rl_train.main(config))
    return log_path / "metrics.jsonl"


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
