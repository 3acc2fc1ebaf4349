"""A byte-level BPE tokenizer with a chat template, trained in code on generated text.

It stands in for the tokenizers of real chat models (Llama 3, Qwen 2.5): byte-level
BPE with merges learned from text (no unknown token: any byte sequence encodes),
digits split one per token as Llama 2/Qwen/DeepSeek do, a BOS that the tokenizer
adds to plain text, a ChatML-style Jinja chat template that writes the BOS itself,
and two end-of-sequence tokens (end of turn and end of text) like Llama-3.x-Instruct.
The training text comes from built-in tasks (by their catalog names: models/ does
not depend on data/) and a seeded word generator, so
the vocabulary (and every model made with it) is the same on every machine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from rlserve.catalog import TASKS
from rlserve.models.tokenizer import SpecialIds

PAD, BOS, EOT, IM_START, IM_END = "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOT, IM_START, IM_END)
VOCAB_SIZE = 640

# ChatML turns; the template, not the tokenizer, writes the BOS (as Llama 3's does).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The tasks whose text trains the merges (fixed: a task added later must not change the tokenizer,
# and so the `tiny-chat` preset, of earlier runs).
_TRAINING_TASKS = ("addition", "multiplication", "countdown", "reverse", "sort")

_WORDS = ("the answer is sum of and what number plus times minus reverse sort letters word write digits "
          "compute result question please solve step first then total each how many make from using "
          "system user assistant you are a helpful careful math tutor give only final").split()


def training_text(seed: int = 0, n: int = 20000) -> list[str]:
    """Deterministic text: task prompts with answers, chat turns, and word sequences."""
    rng = random.Random(seed)
    classes = [TASKS.load(name) for name in _TRAINING_TASKS]
    tasks = [cls(cls.parse_args({})) for cls in classes]
    lines = []
    for i in range(n):
        ex = tasks[i % len(tasks)].example(rng)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(f"{ex.prompt}{ex.answer}")
        lines.append(words.capitalize() + rng.choice(".?!:"))
        lines.append(f"user\n{words} {ex.prompt}\nassistant\n{ex.answer}\n")
    return lines


def build_bpe_tokenizer(seed: int = 0) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # One token per digit, then GPT-2's byte-level split (words with their leading space).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def save_bpe_tokenizer(out_dir: Path, model_max_length: int) -> SpecialIds:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja and special_tokens_map.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_bpe_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    special_map = {"bos_token": BOS, "eos_token": IM_END, "pad_token": PAD,
                   "additional_special_tokens": [EOT, IM_START]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    # End of turn first (the tokenizer's eos_token), then end of text.
    return SpecialIds(tok.get_vocab_size(), tok.token_to_id(BOS), [tok.token_to_id(IM_END), tok.token_to_id(EOT)],
                      tok.token_to_id(PAD))
