"""Prompt tokenization: the chat template applied as transformers applies it (BOS once, from the
template), raw prompts with the tokenizer's own BOS, several EOS ids, and SFT answers that end
where the template ends the assistant's turn."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rlserve.data.prompts import PromptTokenizer, eos_token_ids
from rlserve.data.tasks import Example
from rlserve.models.bpe import save_bpe_tokenizer
from rlserve.models.tokenizer import save_tokenizer

CHAT = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+30?"},
        {"role": "assistant", "content": "42"}, {"role": "user", "content": "And 1+1?"})


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tokenizer files of the tiny-chat preset with a Llama-3.x-Instruct-like config: EOS listed."""
    path = tmp_path_factory.mktemp("chat")
    ids = save_bpe_tokenizer(path, 256)
    (path / "config.json").write_text(json.dumps({"eos_token_id": ids.eos, "bos_token_id": ids.bos}))
    return path


@pytest.mark.parametrize("example, system", [
    (Example("What is 12+30?", "42"), None), (Example("What is 12+30?", "42"), "Answer with digits only."),
    (Example("And 1+1?", "2", messages=CHAT), None)])
def test_chat_prompts_are_what_transformers_apply_chat_template_gives(chat_model, example, system):
    tok = PromptTokenizer(chat_model, "chat", system)
    hf = AutoTokenizer.from_pretrained(chat_model)
    messages = list(example.messages) if example.messages else \
        [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": example.prompt}]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    got = tok.prompt_ids(example)
    assert got == want
    assert got.count(hf.bos_token_id) == 1 and got[0] == hf.bos_token_id  # the template's BOS, not a second one
    assert hf.decode(got).endswith("<|im_start|>assistant\n")


def test_raw_prompts_get_the_tokenizers_own_bos(chat_model, tmp_path):
    ex = Example("12+30=", "42")
    bpe = PromptTokenizer(chat_model, "raw", None)
    assert bpe.prompt_ids(ex) == AutoTokenizer.from_pretrained(chat_model)("12+30=").input_ids
    assert bpe.prompt_ids(ex)[0] == bpe.tok.bos_token_id
    save_tokenizer(tmp_path, 64)  # the character tokenizer adds no BOS, as before
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    char = PromptTokenizer(tmp_path, "raw", None)
    assert char.prompt_ids(ex) == char.encode("12+30=") and len(char.prompt_ids(ex)) == 6
    with pytest.raises(ValueError, match="data.prompt_format: 'chat' needs a chat template"):
        PromptTokenizer(tmp_path, "chat", None)
    with pytest.raises(ValueError, match="needs data.prompt_format: chat"):
        char.prompt_ids(Example("x", "y", messages=({"role": "user", "content": "x"},)))


def test_the_longest_prompt_is_measured_as_each_prompt_tokenizes(chat_model, tmp_path):
    """The preflight's batch count equals the longest single prompt, raw or chat, for both tokenizers."""
    examples = [Example("1+1=", "2"), Example("123456+654321=", "777777"), Example("9=", "9")]
    save_tokenizer(tmp_path, 64)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    for tok in (PromptTokenizer(chat_model, "raw", None), PromptTokenizer(chat_model, "chat", "Be brief."),
                PromptTokenizer(tmp_path, "raw", None)):
        assert tok.longest_prompt(examples) == max(len(tok.prompt_ids(ex)) for ex in examples)
    with pytest.raises(ValueError, match="needs data.prompt_format: chat"):
        PromptTokenizer(chat_model, "raw", None).longest_prompt([Example("x", "y", messages=CHAT)])

def test_sft_answers_end_with_the_turns_eos(chat_model):
    tok = PromptTokenizer(chat_model, "chat", None)
    ex = Example("What is 12+30?", "42")
    seq, n_prompt = tok.sft_ids(ex)
    assert seq[:n_prompt] == tok.prompt_ids(ex)
    assert tok.tok.decode(seq[n_prompt:]) == "42<|im_end|>"  # not the newline the template writes after it
    raw, n_raw = PromptTokenizer(chat_model, "raw", None).sft_ids(ex)
    assert raw[n_raw:] == tok.encode("42") + [tok.tok.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("config, generation, want", [
    ({"eos_token_id": [128001, 128008, 128009]}, None, [128009, 128001, 128008]),  # Llama-3.1-Instruct
    ({"eos_token_id": 1}, {"eos_token_id": [1, 106]}, [128009, 1, 106]),  # Gemma-3: the turn end in generation_config
    ({}, None, [128009]),
])
def test_every_eos_id_is_found(tmp_path, config, generation, want):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    assert eos_token_ids(tmp_path, 128009) == want


def test_a_model_without_any_eos_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no eos_token_id"):
        eos_token_ids(tmp_path, None)


def test_several_eos_ids_from_the_model_folder(chat_model):
    tok = PromptTokenizer(chat_model, "chat", None)
    names = tok.tok.convert_ids_to_tokens(tok.eos_ids)
    assert names == ["<|im_end|>", "<|end_of_text|>"]


def test_sft_tokens_train_every_assistant_turn_and_nothing_else(chat_model):
    """CHAT holds an earlier assistant turn ("42"); the answer is the final one ("2"). Both are trained, each
    through the token that ends its turn; the system and user turns and the template's markup are not."""
    tok = PromptTokenizer(chat_model, "chat", None)
    ids, mask = tok.sft_tokens(Example("And 1+1?", "2", messages=CHAT))
    assert ids == tok.sft_ids(Example("And 1+1?", "2", messages=CHAT))[0]
    spans, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(tok.tok.decode(ids[start:i]))
            start = None
    assert spans == ["42<|im_end|>", "2<|im_end|>"]
    raw = PromptTokenizer(chat_model, "raw", None)
    ids, mask = raw.sft_tokens(Example("1+1=", "2"))
    assert sum(mask) == len(ids) - len(raw.prompt_ids(Example("1+1=", "2"))) and mask[-1]


def test_a_demonstration_trains_its_assistant_turns_after_the_prompt(chat_model):
    """The played episode (guesses, the environment's answers, the last guess) follows the prompt's own
    messages (here with the system prompt); its guesses are trained, the answers heard are not."""
    tok = PromptTokenizer(chat_model, "chat", "Guess.")
    played = ({"role": "assistant", "content": "4"}, {"role": "user", "content": "higher"},
              {"role": "assistant", "content": "6"})
    ids, mask = tok.sft_tokens(Example("guess my number from 1 to 8.", "6", env_args={"target": 6},
                                       demonstration=played))
    assert tok.tok.decode(ids) == tok.tok.apply_chat_template(
        [{"role": "system", "content": "Guess."}, {"role": "user", "content": "guess my number from 1 to 8."},
         *played], tokenize=False).removesuffix("\n")  # the sequence ends with the turn's EOS
    assert tok.tok.decode([i for i, m in zip(ids, mask) if m]) == "4<|im_end|>6<|im_end|>"


TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def test_tools_an_environment_declares_are_rendered_by_a_template_that_takes_tools(chat_model, tmp_path):
    """A template that renders `tools=` (as Qwen's and Llama 3.1's do) gets them, exactly as transformers'
    apply_chat_template renders them; one that does not is refused rather than silently dropping them."""
    tok = PromptTokenizer(chat_model, "chat", None)
    messages = [{"role": "user", "content": "What is 1234*5678?"}]
    with pytest.raises(ValueError, match="renders no tools"):
        tok.episode_prompt_ids(messages, TOOLS)
    assert tok.episode_prompt_ids(messages) == tok.episode_prompt_ids(messages, None)

    hf = AutoTokenizer.from_pretrained(chat_model)
    hf.chat_template = ("{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
                        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((chat_model / "config.json").read_text())
    tools_tok = PromptTokenizer(tmp_path, "chat", None)
    ids = tools_tok.episode_prompt_ids(messages, TOOLS)
    want = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"calculator"' in want and ids == hf.encode(want, add_special_tokens=False)
    with pytest.raises(ValueError, match="raw"):
        PromptTokenizer(chat_model, "raw", None).episode_prompt_ids(messages, TOOLS)
