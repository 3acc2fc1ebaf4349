"""A generative judge: a chat model, run with transformers' `generate`, scores each completion against
a rubric.

The rubric is the user message of a one-turn conversation rendered with the judge model's chat
template ({prompt}, {completion} and {answer} are filled in). The model answers greedily, for
the whole batch at once, and `parse_score` reads the first number of the answer (`7`, `7/10`,
`Score: 7.5`). An answer with no number in [min_score, max_score] scores 0 and counts in the
`unparsed` metric (reward/llm_judge/unparsed in the step's metrics): a judge that rambles costs
reward, never an error. Scores are rescaled to [0, 1].

The model runs inside the reward replica (on its GPU when it has one), so a judge swaps with the
reward app like any other function and never shares the policy's engine, whose weights change
every step; it needs greedy answers only, not a rollout engine (no logprobs, adapters or weight
updates). The model folder must be on the cluster's allow-list (`reward.allowed_models`), or a
generated `preset:` chat model.
"""

from __future__ import annotations

import math
import re
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from rlserve.devices import resolve_device
from rlserve.models import generation
from rlserve.rewards.interfaces import BatchRewardFunction, RewardInput, RewardOutput
from rlserve.rewards.reward_model import check_int, check_template

DEFAULT_RUBRIC = ("Rate the response to the question from {min_score} to {max_score}, where {max_score} is a fully "
                  "correct and helpful answer. Reply with the number only.\n\nQuestion: {prompt}\n\n"
                  "Response: {completion}")
MAX_NEW_TOKENS = 512
MAX_RUBRIC_CHARS = 20_000
# A number, optionally signed and with decimals: the first one in the answer is the score.
_NUMBER = re.compile(r"(?<![\w.])-?[0-9]+(?:\.[0-9]+)?")


def parse_score(text: str, min_score: float, max_score: float) -> float | None:
    """The first number in `text` if it lies in [min_score, max_score], else None (never raises)."""
    match = _NUMBER.search(text or "")
    if match is None:
        return None
    try:
        value = float(match.group())
    except ValueError:
        return None
    return value if math.isfinite(value) and min_score <= value <= max_score else None


class ChatModel:
    """A chat model that answers greedily, a batch at a time (callers hold `lock`)."""

    def __init__(self, path: Path, max_model_len: int):
        from transformers import AutoTokenizer

        from rlserve.models.architecture import load_causal_lm

        self.tokenizer: Any = AutoTokenizer.from_pretrained(path)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model: {str(path)[:200]!r} has no chat template; a judge must be a chat model")
        self.max_model_len = max_model_len
        self.device = resolve_device("auto")
        self.model = load_causal_lm(path, torch.float32).to(self.device).eval()
        self.eos_ids = generation.eos_ids(self.model, self.tokenizer)
        self.pad_id = generation.pad_id(self.tokenizer, self.eos_ids)
        self.lock = threading.Lock()

    @torch.inference_mode()
    def answer(self, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        """The greedy answer to each prompt (token ids), up to its first EOS."""
        input_ids, attention = generation.left_padded(prompts, self.pad_id)
        width = input_ids.shape[1]
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                  do_sample=False, temperature=None, top_p=None, top_k=None,
                                  max_new_tokens=max_new_tokens, eos_token_id=sorted(self.eos_ids),
                                  pad_token_id=self.pad_id)
        answers = []
        for row in out[:, width:].tolist():
            end = next((k for k, tok in enumerate(row) if tok in self.eos_ids), len(row))
            answers.append(self.tokenizer.decode(row[:end], skip_special_tokens=True))
        return answers


@lru_cache(maxsize=2)
def _chat_model(model: str, max_model_len: int) -> ChatModel:
    from rlserve.models import resolve_model

    path = resolve_model(model) if model.startswith("preset:") else Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {model[:200]!r} is not an HF model folder (no config.json)")
    return ChatModel(path, max_model_len)


class LlmJudge(BatchRewardFunction):
    name = "llm_judge"

    def __init__(self, model: str, rubric: str = DEFAULT_RUBRIC, min_score: float = 0.0, max_score: float = 10.0,
                 max_new_tokens: int = 8, max_model_len: int = 2048, batch_size: int = 32):
        if not isinstance(model, str) or not model:
            raise ValueError("model: the judge's chat model folder (or preset:NAME) is required")
        if not isinstance(rubric, str) or not 0 < len(rubric) <= MAX_RUBRIC_CHARS:
            raise ValueError(f"rubric: a string of 1..{MAX_RUBRIC_CHARS} characters")
        for key, value in (("min_score", min_score), ("max_score", max_score)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{key}: must be a finite number, got {value!r}")
        if not min_score < max_score:
            raise ValueError(f"max_score: must be above min_score ({min_score}), got {max_score}")
        self.rubric = rubric.replace("{min_score}", f"{min_score:g}").replace("{max_score}", f"{max_score:g}")
        check_template(self.rubric, "rubric")
        self.min_score, self.max_score = float(min_score), float(max_score)
        self.max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS)
        self.batch_size = check_int("batch_size", batch_size, 1, 1024)
        self.chat = _chat_model(model, check_int("max_model_len", max_model_len, 16, 131072))

    def _prompt(self, item: RewardInput) -> list[int]:
        tok = self.chat.tokenizer
        text = self.rubric.format(prompt=item.prompt, completion=item.completion, answer=item.answer)
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        ids = tok.encode(rendered, add_special_tokens=False)
        room = self.chat.max_model_len - self.max_new_tokens
        return ids[-room:]  # keep the end: the template's generation prompt must stay

    def score_batch(self, items: list[RewardInput]) -> list[RewardOutput]:
        prompts = [self._prompt(i) for i in items]
        answers = []
        with self.chat.lock:  # the model answers one batch at a time
            for start in range(0, len(prompts), self.batch_size):
                answers += self.chat.answer(prompts[start:start + self.batch_size], self.max_new_tokens)
        outs = []
        for text in answers:
            value = parse_score(text, self.min_score, self.max_score)
            if value is None:
                outs.append(RewardOutput(0.0, {"answer": text[:200]}, {"unparsed": 1.0}))
            else:
                outs.append(RewardOutput((value - self.min_score) / (self.max_score - self.min_score),
                                         {"answer": text[:200]}, {"unparsed": 0.0}))
        return outs
