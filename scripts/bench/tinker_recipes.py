"""The tinker-cookbook's own recipes `sl_loop.py` and `rl_loop.py` against an rlserve cluster's Tinker API,
changed only in the lines the issue allows: the renderer line (the model's renderer, registered with the
cookbook by `rlserve.tinker.cookbook`) and the line that loads the dataset (a local JSONL instead of the
Hugging Face hub, which cannot be reached here). The base URL, the model name and the sizes are the recipes'
own config keys on their command line; the key is `TINKER_API_KEY`.

The model is generated: the `tiny` preset (characters, among them `\\ { } #`) with room for rl_loop's few-shot
prefix (max_position_embeddings 1024; RoPE has no learned positions), warmed up in this process by full-weight
SFT on rl_loop's own prompt format (sums of operands 0-5, answers as `\\boxed{N}`) until it answers some of
them, since RL learns only from the rewards it gets (the demo's run starts from such a warm start too). Its
chat template renders exactly as the cookbook renderer does (checked), so an rlserve run sees the same tokens.
The cluster (of the test cluster's shape) deploys that model; sl_loop trains a LoRA adapter on it with the
same conversations, and rl_loop trains another from the base on GSM8K-shaped rows with its own reward.
`--compare` then submits the same algorithm as an rlserve run from the same base (LoRA of the same rank,
the same prompts, batch, group, learning rate, Adam betas and steps; GRPO's loss with rewards centred per
group and not scaled, no KL, as rl_loop's importance sampling is on its own samples). Accuracy (the JSON's
`held_out_*`): greedy answers to 64 problems drawn with another seed, graded as rl_loop grades (the SDK's
sampler on the base and on rl_loop's final weights; the run's own greedy validation on the same rows). With
operands 0-5 there are 36 sums, so these problems repeat training's: the number measures what RL improved
on the task, not generalisation to unseen problems. The defaults are the settings that learned
(BENCHMARKS.md).

    flock /tmp/rlserve-integration.lock .venv/bin/python scripts/bench/tinker_recipes.py [--compare]

Prints one JSON line (and writes bench-results/tinker_recipes.json): rewards per batch, held-out accuracy
before and after, seconds.
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
from rlserve.tinker.cookbook import RENDERER, register  # noqa: E402
from scripts.bench.common import record  # noqa: E402

RECIPES = Path(__import__("tinker_cookbook").__file__).parent / "recipes"
RENDERER_LINE = "renderer_name = model_info.get_recommended_renderer_name(config.model_name)"
DATASET_LINES = {"sl_loop.py": 'dataset = datasets.load_dataset("HuggingFaceH4/no_robots")',
                 "rl_loop.py": 'dataset = datasets.load_dataset("openai/gsm8k", "main")'}
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
PREFIX = [{"role": "user", "content": "How many r's are in strawberry?" + SUFFIX},
          {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
                                           "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. "
                                           "\\boxed{3}"}]
# rlserve.tinker.cookbook.PlainChatRenderer as a chat template: BOS, then `role: content` turns, lowercased (the tiny
# preset's characters have no capitals), each assistant turn ended by EOS, a user turn by a newline.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] | lower }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
RUNNER = """import runpy, sys
from rlserve.tinker.cookbook import register
register(sys.argv[1], sys.argv[2])
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def recipe(name: str, data: Path, out: Path) -> Path:
    """The installed recipe with its renderer line and dataset line changed (each found exactly once)."""
    text = (RECIPES / name).read_text()
    for old, new in ((RENDERER_LINE, f'renderer_name = "{RENDERER}"'),
                     (DATASET_LINES[name], f'dataset = datasets.load_dataset("json", data_files={{"train": "{data}"}})')):
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    path = out / name
    path.write_text(text)
    return path


def conversation(x: int, y: int, answered: bool) -> list[dict[str, str]]:
    """rl_loop's prompt for "x + y" (its few-shot prefix and question suffix), with the answer if `answered`."""
    convo = [*PREFIX, {"role": "user", "content": f"What is {x} + {y}?" + SUFFIX}]
    return [*convo, {"role": "assistant", "content": f"\\boxed{{{x + y}}}"}] if answered else convo


def problems(n: int, seed: int, high: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(0, high), rng.randint(0, high)) for _ in range(n)]


def warm_base(models_dir: Path, steps: int, lr: float, high: int) -> Path:
    """The `tiny` preset with room for rl_loop's prefix, full-weight SFT'd on rl_loop's format (lr decaying
    linearly to 0, batches of 32), and a chat template that renders as the cookbook renderer (asserted)."""
    import torch
    from tinker_cookbook import renderers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = models_dir / "tiny-warm"
    shutil.copytree(resolve_model("preset:tiny"), folder)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        config = json.loads((folder / name).read_text())
        config[key] = 1024
        (folder / name).write_text(json.dumps(config, indent=2))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    register(f"rlserve/{folder.name}", folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    renderer = renderers.get_renderer(RENDERER, tokenizer)
    probe = conversation(3, 4, answered=False)
    templated = tokenizer.encode(tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False),
                                 add_special_tokens=False)
    assert templated == renderer.build_generation_prompt(probe).to_ints(), "chat template != renderer"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    rng = random.Random(1)
    for _ in range(steps):
        rows = []
        for _ in range(32):
            model_input, weights = renderer.build_supervised_example(
                conversation(rng.randint(0, high), rng.randint(0, high), answered=True))
            rows.append((model_input.to_ints(), weights.tolist()))
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([t + [0] * (width - len(t)) for t, _ in rows])
        weights = torch.tensor([w + [0.0] * (width - len(w)) for _, w in rows])[:, 1:]
        logits = model(ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * weights).sum() / weights.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.save_pretrained(folder)
    return folder


def data(work: Path, n: int, seed: int, high: int) -> tuple[Path, Path]:
    """sl_loop's conversations (rl_loop's prompt, answered) and rl_loop's GSM8K-shaped rows."""
    sl, rl = work / "sl.jsonl", work / "rl.jsonl"
    with sl.open("w") as f_sl, rl.open("w") as f_rl:
        for x, y in problems(n, seed, high):
            f_sl.write(json.dumps({"messages": conversation(x, y, answered=True)}) + "\n")
            f_rl.write(json.dumps({"question": f"What is {x} + {y}?", "answer": f"{x} + {y} = {x + y}\n#### {x + y}"})
                       + "\n")
    return sl, rl


def graded(text: str, answer: int) -> float:
    """rl_loop's own grading: the `\\boxed{}` answer against the reference."""
    from tinker_cookbook.recipes.math_rl.math_grading import extract_boxed, grade_answer

    try:
        return float(grade_answer(extract_boxed(text), str(answer)))
    except ValueError:
        return 0.0


def held_out(url: str, key: str, model: str, held: list[tuple[int, int]], sampler_path: str | None) -> float:
    """Greedy accuracy on `held` through the SDK's sampler: the base model, or the weights at `sampler_path`."""
    import tinker
    from tinker import types
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    renderer = renderers.get_renderer(RENDERER, get_tokenizer(model))
    client = tinker.ServiceClient(base_url=url, api_key=key)
    sampler = (client.create_sampling_client(model_path=sampler_path) if sampler_path
               else client.create_sampling_client(base_model=model))
    params = types.SamplingParams(max_tokens=12, temperature=0.0, stop=renderer.get_stop_sequences())
    futures = [sampler.sample(renderer.build_generation_prompt(conversation(x, y, answered=False)), 1, params)
               for x, y in held]
    right = 0.0
    for (x, y), future in zip(held, futures):
        message, _ = renderer.parse_response(future.result().sequences[0].tokens)
        right += graded(renderers.get_text_content(message), x + y)
    return right / len(held)


def run_recipe(path: Path, model: str, folder: Path, args: list[str], key: str) -> float:
    t0 = time.perf_counter()
    env = {**os.environ, "TINKER_API_KEY": key, "PYTHONPATH": str(ROOT / "libs")}
    subprocess.run([sys.executable, "-c", RUNNER, model, str(folder), str(path), *args], env=env, check=True)
    return time.perf_counter() - t0


def rlserve_run(cluster, folder: Path, work: Path, rows: list[tuple[int, int]], held: list[tuple[int, int]],
                a: argparse.Namespace) -> dict:
    """rl_loop's algorithm as an rlserve run from the same base: returns its held-out curve and seconds."""
    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.v1 import coordinator_pb2 as pb

    for name, part in (("train", rows), ("val", held)):
        with (work / f"rlserve-{name}.jsonl").open("w") as f:
            for x, y in part:
                f.write(json.dumps({"messages": conversation(x, y, answered=False), "answer": str(x + y)}) + "\n")
    spec = {
        "name": "rl-loop-as-a-run",
        "policy": {"model_name": str(folder), "max_total_sequence_length": 640, "precision": "float32",
                   "train_global_batch_size": a.rl_batch * a.group, "train_micro_batch_size": a.rl_batch * a.group,
                   "max_grad_norm": 1e9,
                   "optimizer": {"kwargs": {"lr": a.rl_lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
                   "dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": a.rank, "alpha": 32,
                                                "match_all_linear": True}},
                   "generation": {"temperature": 1.0, "max_new_tokens": 12}},
        "grpo": {"num_prompts_per_step": a.rl_batch, "num_generations_per_prompt": a.group,
                 "max_num_steps": a.rl_steps, "val_period": a.rl_steps, "max_val_samples": len(held),
                 "adv_estimator": {"name": "grpo", "normalize_rewards": False}, "async_grpo": {"enabled": False}},
        "loss_fn": {"name": "grpo", "reference_policy_kl_penalty": 0.0, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2},
        "data": {"task": "jsonl", "train_path": str(work / "rlserve-train.jsonl"),
                 "val_path": str(work / "rlserve-val.jsonl"), "prompt_format": "chat", "num_val": len(held)},
        "reward": {"functions": [{"name": "math_verify"}]},
        "checkpointing": {"enabled": False},
        "cluster": {"num_workers": 1, "torch_threads": 2},
    }
    t0 = time.perf_counter()
    curve = []
    with CoordinatorClient(cluster.grpc_endpoint) as coordinator:
        run = coordinator.submit(yaml.safe_dump(spec))
        for ev in coordinator.watch(run.run_id, timeout_s=3600):
            if ev.kind == pb.EVENT_KIND_VALIDATION:
                curve.append({"step": ev.step, "held_out": ev.metrics["val/reward"]})
            elif ev.kind == pb.EVENT_KIND_ERROR:
                raise RuntimeError(f"run {run.run_id}: {ev.message}")
        final = coordinator.get(run.run_id)
    return {"state": pb.RunState.Name(final.state), "curve": curve, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm-steps", type=int, default=300, help="the base's full-weight SFT steps (32 rows each)")
    p.add_argument("--warm-lr", type=float, default=2e-3)
    p.add_argument("--high", type=int, default=5, help="operands in [0, high]")
    p.add_argument("--sl-steps", type=int, default=20)
    p.add_argument("--sl-batch", type=int, default=32)
    p.add_argument("--rl-steps", type=int, default=30)
    p.add_argument("--rl-batch", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rl-lr", type=float, default=3e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--compare", action="store_true", help="also rl_loop's algorithm as an rlserve run")
    a = p.parse_args()
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up
    from rlserve.security.users import add_user
    from tests.integration.conftest import HERE, install_plugins

    t0 = time.perf_counter()
    out: dict = {"command": "scripts/bench/tinker_recipes.py " + " ".join(sys.argv[1:])}
    with tempfile.TemporaryDirectory(prefix="tinker-recipes-") as tmp:
        work = Path(tmp)
        folder = warm_base(work / "models", a.warm_steps, a.warm_lr, a.high)
        out["warm_seconds"] = round(time.perf_counter() - t0, 1)
        sl_data, rl_data = data(work, max(a.sl_steps * a.sl_batch, a.rl_steps * a.rl_batch), 0, a.high)
        held = problems(64, 12345, a.high)
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
            common = [f"base_url={url}", f"model_name={model}", f"lora_rank={a.rank}", "save_every=0",
                      "ttl_seconds=3600"]
            sl_log, rl_log = work / "sl-log", work / "rl-log"
            out["sl_seconds"] = round(run_recipe(
                recipe("sl_loop.py", sl_data, work), model, folder,
                [*common, f"log_path={sl_log}", f"batch_size={a.sl_batch}", f"max_steps={a.sl_steps}",
                 "learning_rate=1e-3", "max_length=640"], key), 1)
            out["held_out_base"] = held_out(url, key, model, held, None)
            out["rl_seconds"] = round(run_recipe(
                recipe("rl_loop.py", rl_data, work), model, folder,
                [*common, f"log_path={rl_log}", f"batch_size={a.rl_batch}", f"group_size={a.group}",
                 f"max_steps={a.rl_steps}", "max_tokens=12", f"learning_rate={a.rl_lr}",
                 "loss_fn=importance_sampling"], key), 1)
            final = [json.loads(x) for x in (rl_log / "checkpoints.jsonl").read_text().splitlines() if x.strip()][-1]
            out["held_out_rl_loop"] = held_out(url, key, model, held, final["sampler_path"])
            if a.compare:
                rows = problems(a.rl_steps * a.rl_batch, 0, a.high)
                out["rlserve_run"] = rlserve_run(cluster, folder, work, rows, held, a)
        finally:
            down(cluster)
        sl_m = [json.loads(x) for x in (sl_log / "metrics.jsonl").read_text().splitlines() if x.strip()]
        rl_m = [json.loads(x) for x in (rl_log / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rewards = [m["reward/total"] for m in rl_m if "reward/total" in m]
    k = max(1, len(rewards) // 5)
    out.update({"model": model, "sl_steps": len(sl_m), "sl_nll_first": sl_m[0].get("train_mean_nll"),
                "sl_nll_last": sl_m[-1].get("train_mean_nll"), "rl_batches": len(rewards),
                "rl_reward_first_fifth": sum(rewards[:k]) / k, "rl_reward_last_fifth": sum(rewards[-k:]) / k,
                "rl_rewards": rewards})
    print(json.dumps(out))
    record("tinker_recipes", [out], {})


if __name__ == "__main__":
    main()
