"""TRL's GRPOTrainer on the demo workload, for scripts/bench/vs_trl.py. Runs in the TRL benchmark environment
(`bench-envs/trl`, made by vs_trl.py), never in the project's: it imports neither rlserve nor Ray.

Input (--data): the start model's folder, the training prompts in the order rlserve's sampler takes them,
the held-out prompts, and the hyperparameters. Output (--out): held-out greedy reward every `val_period`
steps against train seconds (evaluation excluded) and trajectories trained, and each RL step's seconds by
phase (`phases`, the same batch as rlserve's step: generation, reward, the other scoring (old-policy
log-probabilities, advantages), forward and backward, and the optimizer with the rest), timed by wrapping
the trainer's own methods.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict
from pathlib import Path

import torch


def greedy_reward(model, tok, rows: list[dict], max_new_tokens: int) -> float:  # noqa: ANN001 - HF objects
    """Exact match of the greedy completion, as rlserve's validation scores it."""
    tok.padding_side = "left"
    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True, add_special_tokens=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(t.strip() == r["answer"].strip() for t, r in zip(texts, rows)) / len(rows)


def main() -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    data = json.loads(args.data.read_text())
    hp = data["hyperparameters"]
    torch.set_num_threads(hp["threads"])
    torch.manual_seed(hp["seed"])
    tok = AutoTokenizer.from_pretrained(data["model"])
    model = AutoModelForCausalLM.from_pretrained(data["model"], dtype=torch.float32)
    answers = {r["prompt"]: r["answer"] for r in data["train"]}

    def exact_match(prompts: list[str], completions: list[str], **_: object) -> list[float]:
        return [float(c.strip() == answers[p].strip()) for p, c in zip(prompts, completions)]

    updates_per_step = hp["trajectories_per_step"] // hp["update_batch_size"]
    config = GRPOConfig(
        output_dir=str(args.out.parent / "trl-out"), use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=updates_per_step, seed=hp["seed"], shuffle_dataset=False,
        per_device_train_batch_size=hp["update_batch_size"], gradient_accumulation_steps=1,
        steps_per_generation=updates_per_step, num_generations=hp["num_generations"],
        max_completion_length=hp["max_new_tokens"], temperature=hp["temperature"], top_p=1.0,
        learning_rate=hp["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=hp["weight_decay"],
        adam_beta1=hp["betas"][0], adam_beta2=hp["betas"][1], adam_epsilon=hp["eps"],
        max_grad_norm=hp["max_grad_norm"], beta=0.0, num_iterations=1, epsilon=hp["clip"],
        scale_rewards="group", loss_type="dapo", max_steps=hp["steps"] * updates_per_step,
        dataloader_num_workers=0, disable_dropout=True)
    points: list[dict] = []
    spent: dict[str, float] = defaultdict(float)  # method -> seconds inside it so far
    phases: list[dict] = []

    class HeldOut(TrainerCallback):
        """Held-out reward every `val_period` RL steps; the time it takes is not train time."""

        def __init__(self):
            self.eval_s, self.t0 = 0.0, None
            self.step_t0, self.step_spent = None, {}

        def _evaluate(self, step: int) -> None:
            t = time.perf_counter()
            model.eval()
            reward = greedy_reward(model, tok, data["val"], hp["max_new_tokens"])
            model.train()
            self.eval_s += time.perf_counter() - t
            points.append({"step": step, "train_s": time.perf_counter() - self.t0 - self.eval_s,
                           "trajectories": step * hp["trajectories_per_step"], "val_reward": reward})
            print(f"trl: step {step} held-out {reward:.3f} train {points[-1]['train_s']:.1f}s", flush=True)

        def on_train_begin(self, *_: object, **__: object) -> None:
            self.t0 = time.perf_counter()
            self._evaluate(0)
            self.step_t0, self.step_spent = time.perf_counter(), dict(spent)

        def on_step_end(self, _args: object, state, *__: object, **___: object) -> None:  # noqa: ANN001
            if state.global_step % updates_per_step == 0:
                step = state.global_step // updates_per_step
                phases.append(step_phases(time.perf_counter() - self.step_t0,
                                          {k: v - self.step_spent.get(k, 0.0) for k, v in spent.items()}))
                if step % hp["val_period"] == 0 or step == hp["steps"]:
                    self._evaluate(step)
                self.step_t0, self.step_spent = time.perf_counter(), dict(spent)

    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, processing_class=tok,
                          train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in data["train"]]),
                          callbacks=[HeldOut()])
    for name in ("_generate_and_score_completions", "_generate_single_turn", "_calculate_rewards", "training_step"):
        setattr(trainer, name, timed(getattr(trainer, name), name, spent))
    trainer.train()
    args.out.write_text(json.dumps({"points": points, "phases": phases}, indent=1))


def timed(method, name: str, spent: dict[str, float]):  # noqa: ANN001, ANN201 - a bound method of the trainer
    """`method`, adding the seconds each call takes to `spent[name]`."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0
    return wrapper


def step_phases(step_s: float, spent: dict[str, float]) -> dict[str, float]:
    """One RL step's seconds by phase: HF's `training_step` holds TRL's `_prepare_inputs`, which generates and
    scores once a step (`_generate_and_score_completions`: generation, the rewards, the rest of the scoring); the
    optimizer steps and the trainer's own work are what the step took outside `training_step`."""
    score = spent.get("_generate_and_score_completions", 0.0)
    generate, reward = spent.get("_generate_single_turn", 0.0), spent.get("_calculate_rewards", 0.0)
    train = spent.get("training_step", 0.0)
    return {"step_s": step_s, "generate_s": generate, "reward_s": reward, "scoring_other_s": score - generate - reward,
            "rollouts_s": score, "train_s": train - score, "optimizer_other_s": step_s - train}


if __name__ == "__main__":
    main()
