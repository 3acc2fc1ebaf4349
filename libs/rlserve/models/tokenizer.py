"""A character-level tokenizer over the alphabet of the built-in tasks.

Every symbol is one token, so a tiny model sees the arithmetic digit by digit
and a reward on exact strings maps one-to-one onto token sequences. The file
it writes (`tokenizer.json` + `tokenizer_config.json`) loads in transformers
(`AutoTokenizer`) and in vLLM without any custom code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Digits and letters first so their ids are stable across alphabet additions.
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*/()=,.:;<>?!#\\{}_\n"


@dataclass(frozen=True)
class SpecialIds:
    """What a model config needs from its tokenizer."""

    vocab_size: int
    bos: int
    eos: list[int]  # several for chat models (end of turn, end of text); the first is the tokenizer's eos_token
    pad: int


def build_tokenizer() -> Tokenizer:
    """Build the character tokenizer: specials get ids 0..3, then the alphabet in order."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in ALPHABET:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(ALPHABET)


def token_id(token: str) -> int:
    """The id of one special token or alphabet symbol."""
    if token in SPECIAL_TOKENS:
        return SPECIAL_TOKENS.index(token)
    return len(SPECIAL_TOKENS) + ALPHABET.index(token)


def special_ids() -> SpecialIds:
    return SpecialIds(vocab_size(), token_id(BOS), [token_id(EOS)], token_id(PAD))


def save_tokenizer(out_dir: Path, model_max_length: int) -> SpecialIds:
    """Write tokenizer.json and a tokenizer_config.json that transformers and vLLM accept."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return special_ids()
