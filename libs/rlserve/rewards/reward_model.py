"""A trained reward model as a reward function: an HF `AutoModelForSequenceClassification` folder.

The model reads the prompt and the completion as one text (`template`) and its head gives the
score: the logit of a one-label head (optionally squashed by a sigmoid), or the softmax
probability of `label` for a head of several classes. Batches are scored in chunks of
`batch_size` with right padding. The model folder must be on the cluster's allow-list
(`reward.allowed_models`); one loaded copy per folder serves every function that names it.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from rlserve.devices import resolve_device
from rlserve.rewards.interfaces import BatchRewardFunction, RewardInput, RewardOutput

MAX_BATCH_SIZE = 1024
MAX_LENGTH = 32768
_TEMPLATE_KEYS = ("prompt", "completion", "answer")


def check_template(template: str, arg: str = "template") -> None:
    """ValueError unless `template` uses only {prompt}, {completion} and {answer} (nothing else: it is
    formatted with request text, which must not reach attributes or indexes)."""
    import string

    for _, name, spec, conv in string.Formatter().parse(template):
        if name is not None and (name not in _TEMPLATE_KEYS or spec or conv):
            raise ValueError(f"{arg}: only {{prompt}}, {{completion}} and {{answer}} may be used, got {{{name}}}")


def check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: must be an integer in {low}..{high}, got {value!r}")
    return value


@lru_cache(maxsize=4)
def _load(folder: str, stamp: float) -> tuple[Any, Any, torch.device, threading.Lock]:
    """(model, tokenizer, device, lock) of a folder; `stamp` (config.json's mtime) reloads a replaced model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    device = resolve_device("auto")
    model = AutoModelForSequenceClassification.from_pretrained(folder, torch_dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.truncation_side = "left"  # a text over max_length keeps its end: the completion being scored
    if model.config.pad_token_id is None:
        # The head reads each row's last token that is not padding; a batch needs to know which those are.
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError(f"{folder}: the tokenizer has no pad or EOS token to pad a batch with")
        model.config.pad_token_id = pad
    return model, tokenizer, device, threading.Lock()


def load_model_folder(model: str) -> tuple[Any, Any, torch.device, threading.Lock]:
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {model[:200]!r} is not an HF model folder (no config.json)")
    return _load(str(path), (path / "config.json").stat().st_mtime)


class SequenceClassifierReward(BatchRewardFunction):
    name = "reward_model"

    def __init__(self, model: str, template: str = "{prompt}{completion}", batch_size: int = 16,
                 max_length: int = 1024, sigmoid: bool = False, label: int | None = None):
        if not isinstance(model, str) or not model:
            raise ValueError("model: the reward model's folder is required")
        if not isinstance(template, str):
            raise ValueError("template: must be a string")
        check_template(template)
        self.batch_size = check_int("batch_size", batch_size, 1, MAX_BATCH_SIZE)
        self.max_length = check_int("max_length", max_length, 1, MAX_LENGTH)
        self.template, self.sigmoid = template, bool(sigmoid)
        self.model, self.tokenizer, self.device, self.lock = load_model_folder(model)
        num_labels = self.model.config.num_labels
        if label is not None:
            check_int("label", label, 0, num_labels - 1)
        if sigmoid and num_labels != 1:
            raise ValueError(f"sigmoid: for a one-label head; this model has {num_labels} labels (use `label`)")
        self.label = label if label is not None else num_labels - 1

    def score_batch(self, items: list[RewardInput]) -> list[RewardOutput]:
        texts = [self.template.format(prompt=i.prompt, completion=i.completion, answer=i.answer) for i in items]
        scores: list[float] = []
        with self.lock, torch.inference_mode():  # one forward at a time per loaded model
            for start in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[start:start + self.batch_size], padding=True, truncation=True,
                                     max_length=self.max_length, return_tensors="pt").to(self.device)
                logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.float()
                if logits.shape[-1] == 1:
                    picked = logits[:, 0].sigmoid() if self.sigmoid else logits[:, 0]
                else:
                    picked = logits.softmax(-1)[:, self.label]
                scores += picked.cpu().tolist()
        return [RewardOutput(s) for s in scores]
