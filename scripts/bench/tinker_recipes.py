"""The tinker-cookbook's own recipes `sl_loop.py` and `rl_loop.py` against an rlserve cluster's Tinker API,
changed only in the lines the issue allows: the renderer line (the model's renderer, registered with the
cookbook by `rlserve.tinker.cookbook`) and the line that loads the dataset (a local JSONL instead of the
Hugging Face hub, which cannot be reached here). The base URL, the model name and the sizes are the recipes'
own config keys on their command line; the key is `TINKER_API_KEY`.

The model is generated: the `tiny` preset (characters, among them `\\ { } #`) with room for rl_loop's few-shot
prefix (max_position_embeddings 1024; RoPE has no learned positions), deployed by a local cluster of the test
cluster's shape. sl_loop first teaches it rl_loop's own prompt format on addition problems (answers as
`\\boxed{N}`); rl_loop then starts from sl_loop's last state through its own resume path (the state record
copied into its log_path with batch 0) and trains on GSM8K-shaped addition problems with its own reward.

    flock /tmp/rlserve-integration.lock .venv/bin/python scripts/bench/tinker_recipes.py [--sl-steps 60 --rl-steps 20]

Prints one JSON line: the recipes' reward per batch (first and last fifth) and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from rlserve.models import resolve_model  # noqa: E402

RECIPES = Path(__import__("tinker_cookbook").__file__).parent / "recipes"
RENDERER_LINE = "renderer_name = model_info.get_recommended_renderer_name(config.model_name)"
DATASET_LINES = {"sl_loop.py": 'dataset = datasets.load_dataset("HuggingFaceH4/no_robots")',
                 "rl_loop.py": 'dataset = datasets.load_dataset("openai/gsm8k", "main")'}
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
PREFIX = [{"role": "user", "content": "How many r's are in strawberry?" + SUFFIX},
          {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
                                           "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. "
                                           "\\boxed{3}"}]
RUNNER = """import runpy, sys
from rlserve.tinker.cookbook import register
register(sys.argv[1], sys.argv[2])
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def recipe(name: str, data: Path, out: Path) -> Path:
    """The installed recipe with its renderer line and dataset line changed (each found exactly once)."""
    text = (RECIPES / name).read_text()
    for old, new in ((RENDERER_LINE, 'renderer_name = "rlserve/plain_chat"'),
                     (DATASET_LINES[name], f'dataset = datasets.load_dataset("json", data_files={{"train": "{data}"}})')):
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    path = out / name
    path.write_text(text)
    return path


def generated_model(models_dir: Path) -> Path:
    folder = models_dir / "tiny-1k"
    shutil.copytree(resolve_model("preset:tiny"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["model_max_length"] = 1024
    (folder / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    return folder


def data(work: Path, n: int, seed: int) -> tuple[Path, Path]:
    """sl_loop's conversations (rl_loop's prompt, answered) and rl_loop's GSM8K-shaped rows."""
    rng = random.Random(seed)
    sl, rl = work / "sl.jsonl", work / "rl.jsonl"
    with sl.open("w") as f_sl, rl.open("w") as f_rl:
        for _ in range(n):
            x, y = rng.randint(0, 50), rng.randint(0, 50)
            question = f"What is {x} + {y}?"
            f_sl.write(json.dumps({"messages": [*PREFIX, {"role": "user", "content": question + SUFFIX},
                                                {"role": "assistant", "content": f"\\boxed{{{x + y}}}"}]}) + "\n")
            f_rl.write(json.dumps({"question": question, "answer": f"{x} + {y} = {x + y}\n#### {x + y}"}) + "\n")
    return sl, rl


def run_recipe(path: Path, model: str, folder: Path, args: list[str], key: str) -> float:
    t0 = time.perf_counter()
    env = {**os.environ, "TINKER_API_KEY": key, "PYTHONPATH": str(ROOT / "libs")}
    subprocess.run([sys.executable, "-c", RUNNER, model, str(folder), str(path), *args], env=env, check=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sl-steps", type=int, default=60)
    p.add_argument("--sl-batch", type=int, default=32)
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--rl-batch", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    a = p.parse_args()
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up
    from rlserve.security.users import add_user
    from tests.integration.conftest import HERE, install_plugins

    with tempfile.TemporaryDirectory(prefix="tinker-recipes-") as tmp:
        work = Path(tmp)
        sl_data, rl_data = data(work, max(a.sl_steps * a.sl_batch, a.rl_steps * a.rl_batch), seed=0)
        folder = generated_model(work / "models")
        cluster_yaml = yaml.safe_load((HERE / "cluster.yaml").read_text())
        cluster_yaml["services"]["rollout"]["args"].update(model=str(folder), max_model_len=640, max_lora_rank=32)
        cluster_yaml["services"]["reference"]["args"]["model"] = str(folder)
        cluster_yaml.update(runs_dir=str(work / "runs"), model_dirs=[str(folder.parent)], data_dirs=[str(work)])
        (work / "cluster.yaml").write_text(yaml.safe_dump(cluster_yaml))
        cfg, runs_dir = load_cluster_file(work / "cluster.yaml")
        cluster = Cluster(cfg, runs_dir)
        down(cluster)
        install_plugins()
        up(cluster)
        try:
            key = add_user(cluster.users_file, "recipes", admin=False, tinker=True)
            model, url = f"rlserve/{folder.name}", cluster.http_url
            common = [f"base_url={url}", f"model_name={model}", "lora_rank=16", "save_every=0", "ttl_seconds=3600"]
            sl_log, rl_log = work / "sl-log", work / "rl-log"
            sl_s = run_recipe(recipe("sl_loop.py", sl_data, work), model, folder,
                              [*common, f"log_path={sl_log}", f"batch_size={a.sl_batch}", f"max_steps={a.sl_steps}",
                               "learning_rate=3e-3", "max_length=640"], key)
            # rl_loop resumes from sl_loop's final state (its own resume path), from its first batch.
            last = [json.loads(x) for x in (sl_log / "checkpoints.jsonl").read_text().splitlines() if x.strip()][-1]
            rl_log.mkdir()
            (rl_log / "checkpoints.jsonl").write_text(json.dumps({**last, "batch": 0}) + "\n")
            rl_s = run_recipe(recipe("rl_loop.py", rl_data, work), model, folder,
                              [*common, f"log_path={rl_log}", f"batch_size={a.rl_batch}", f"group_size={a.group}",
                               f"max_steps={a.rl_steps}", "max_tokens=12", "learning_rate=1e-3",
                               "loss_fn=importance_sampling"], key)
        finally:
            down(cluster)
        sl_m = [json.loads(x) for x in (sl_log / "metrics.jsonl").read_text().splitlines() if x.strip()]
        rl_m = [json.loads(x) for x in (rl_log / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rewards = [m["reward/total"] for m in rl_m if "reward/total" in m]
    k = max(1, len(rewards) // 5)
    print(json.dumps({"model": model, "sl_steps": len(sl_m), "sl_nll_first": sl_m[0].get("train_mean_nll"),
                      "sl_nll_last": sl_m[-1].get("train_mean_nll"), "rl_batches": len(rewards),
                      "rl_reward_first_fifth": sum(rewards[:k]) / k, "rl_reward_last_fifth": sum(rewards[-k:]) / k,
                      "rl_rewards": rewards, "sl_seconds": round(sl_s, 1), "rl_seconds": round(rl_s, 1)}))


if __name__ == "__main__":
    main()
