"""Examples -> token ids with the policy's own tokenizer, as raw text or through its chat template.

`raw`: the prompt text as the tokenizer encodes plain text (with the BOS that
its post-processor adds, if any). `chat`: the tokenizer's Jinja chat template
renders the conversation with `add_generation_prompt`, and the rendered text is
encoded without special tokens, because the template writes any BOS itself
(this is what transformers' `apply_chat_template` does).

A multi-turn episode is token-exact: what the engine generated stays as it
was generated, and each environment observation is appended as tokens
rendered from the new messages only (`observation_ids`), never by
re-tokenizing the conversation's text.

Chat models often end a turn with one token and a document with another
(Llama-3.x-Instruct, Gemma-3 list both in `eos_token_id`); every one of them
stops generation, and an SFT answer ends where the template ends the
assistant's turn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlserve.data.tasks import Example


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def eos_token_ids(model_dir: Path, tokenizer_eos: int | None) -> list[int]:
    """Every EOS id of the model: the tokenizer's first, then config.json's and generation_config.json's."""
    found = _ids(tokenizer_eos)
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            found += _ids(json.loads(path.read_text()).get("eos_token_id"))
    ids = list(dict.fromkeys(found))
    if not ids:
        raise ValueError(f"{model_dir}: no eos_token_id in config.json, generation_config.json or the tokenizer")
    return ids


class PromptTokenizer:
    """The policy's own tokenizer, for prompts and SFT answers, in the spec's `data.prompt_format`."""

    def __init__(self, model_dir: Path, prompt_format: str, system_prompt: str | None):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.prompt_format, self.system_prompt = prompt_format, system_prompt
        if prompt_format == "chat" and not self.tok.chat_template:
            raise ValueError(f"data.prompt_format: 'chat' needs a chat template, and the tokenizer of {model_dir} "
                             f"has none (chat_template.jinja or tokenizer_config.json's chat_template); "
                             f"use data.prompt_format: raw")
        self.eos_ids = eos_token_ids(model_dir, self.tok.eos_token_id)

    def encode(self, text: str) -> list[int]:
        """Plain text without special tokens (answers, continuations)."""
        return self.tok.encode(text, add_special_tokens=False)

    def messages(self, ex: Example) -> list[dict[str, str]]:
        """The conversation that the chat template renders for this example."""
        if ex.messages is not None:
            return [dict(m) for m in ex.messages]
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": ex.prompt}]

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> list[int]:
        text = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                            tokenize=False)
        return self.tok.encode(text, add_special_tokens=False)

    def renders_tools(self) -> bool:
        """Whether the chat template renders a `tools=` list (Qwen's, Llama 3.1's, Hermes' do); one that
        does not would drop the tools silently."""
        template = self.tok.chat_template
        sources = template.values() if isinstance(template, dict) else [template or ""]
        return any("tools" in source for source in sources)

    def prompt_ids(self, ex: Example) -> list[int]:
        if self.prompt_format == "chat":
            return self._render(self.messages(ex), add_generation_prompt=True)
        if ex.messages is not None:
            raise ValueError("a 'messages' example needs data.prompt_format: chat")
        return self.tok.encode(ex.prompt, add_special_tokens=True)

    def longest_prompt(self, examples: list[Example]) -> int:
        """The most tokens any of `examples` takes as its prompt. Raw prompts are encoded as one batch: each
        SubmitRun's preflight checks up to thousands, and one `encode` call per prompt cost its CPU."""
        if self.prompt_format == "chat" or any(ex.messages is not None for ex in examples):
            return max((len(self.prompt_ids(ex)) for ex in examples), default=0)
        ids = self.tok([ex.prompt for ex in examples], add_special_tokens=True)["input_ids"]
        return max(map(len, ids), default=0)

    # --- multi-turn episodes -------------------------------------------------------------------

    def episode_prompt_ids(self, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
        """An episode's first messages (and the tools the environment declares) as the policy's prompt: the
        chat template with the generation prompt, or (raw format) the messages' contents as plain text with
        the tokenizer's BOS."""
        if tools and (self.prompt_format != "chat" or not self.renders_tools()):
            raise ValueError("the environment declares tools for the chat template, but "
                             + ("data.prompt_format is raw" if self.prompt_format != "chat"
                                else "the model's chat template renders no tools"))
        if self.prompt_format == "chat":
            return self._render(messages, add_generation_prompt=True, tools=tools)
        return self.tok.encode("".join(m["content"] for m in messages), add_special_tokens=True)

    def observation_ids(self, messages: list[dict[str, str]], last_id: int) -> list[int]:
        """The tokens that follow the policy's turn (whose last token was `last_id`): the template's end
        of that turn, the observation `messages` and the next generation prompt (raw format: the
        contents as plain text).

        Only these messages are rendered, and their text is encoded on its own: the conversation's
        earlier tokens stay exactly as generated. The template's text after an assistant message is
        found on a probe conversation; when the policy's turn ended with an EOS id that the template
        writes there itself (`<|im_end|>`), it is not written twice. The text then begins right after
        a special token, so encoding it apart from the conversation gives the tokens the whole
        conversation would have there.
        """
        if self.prompt_format != "chat":
            return self.encode("".join(m["content"] for m in messages))
        after, gap = self._turn_gap(messages)
        if last_id in self.eos_ids:
            ended = self.tok.convert_ids_to_tokens(last_id)
            if after.startswith(ended):
                after = after[len(ended):]
        return self.encode(after + gap)

    _PROBE = "rlserve-probe-7f3a"

    def _turn_gap(self, messages: list[dict[str, str]]) -> tuple[str, str]:
        """(the template's text after an assistant message's content, then the text the new messages and the
        generation prompt add), from rendering a probe conversation with and without them."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": self._PROBE}]
        base = self.tok.apply_chat_template(probe, add_generation_prompt=False, tokenize=False)
        full = self.tok.apply_chat_template([*probe, *messages], add_generation_prompt=True, tokenize=False)
        if not full.startswith(base) or self._PROBE not in base:
            raise ValueError("the chat template does not render a conversation as a prefix of its continuation, "
                             "so observations cannot be appended as tokens (use data.prompt_format: raw)")
        return base[base.rindex(self._PROBE) + len(self._PROBE):], full[len(base):]

    def sft_ids(self, ex: Example) -> tuple[list[int], int]:
        """(prompt + answer + end token, prompt length) for supervised training on the answer.

        In chat format the template renders the answer as the assistant's turn, and the
        sequence ends at the first EOS id after the prompt (the turn's end; what follows,
        such as a newline before the next turn, is never generated). A template whose
        prompt is not a prefix of the rendered answer turn, or that ends a turn without an
        EOS id, gets the answer's plain tokens and the first EOS id instead.
        """
        prompt = self.prompt_ids(ex)
        if self.prompt_format == "chat":
            full = self._render([*self.messages(ex), {"role": "assistant", "content": ex.answer}],
                                add_generation_prompt=False)
            if full[:len(prompt)] == prompt:
                tail = full[len(prompt):]
                ends = [i for i, t in enumerate(tail) if t in self.eos_ids]
                if ends:
                    return prompt + tail[:ends[0] + 1], len(prompt)
        return prompt + self.encode(ex.answer) + [self.eos_ids[0]], len(prompt)

    def sft_tokens(self, ex: Example) -> tuple[list[int], list[bool]]:
        """The conversation through its answer (`sft_ids`), and which of its tokens SFT trains on: the assistant's.

        Raw format, or a chat row without earlier turns: the answer and its end token. Chat rows
        whose `messages` hold earlier assistant turns train on those too, each from where the
        template starts the turn to the first EOS id after it, found by rendering the conversation
        turn by turn. A turn the template does not render as a prefix of the conversation (one that
        drops earlier turns' reasoning, say) is left untrained. An example with a `demonstration` is
        the played episode: its prompt's messages, then the demonstration, whose last turn is the answer.
        """
        if ex.demonstration:
            played = ex.demonstration
            ex = Example(ex.prompt, played[-1]["content"], ex.metadata, (*self.messages(ex), *played[:-1]))
        ids, prompt_len = self.sft_ids(ex)
        mask = [False] * prompt_len + [True] * (len(ids) - prompt_len)
        if self.prompt_format != "chat" or ex.messages is None:
            return ids, mask
        messages = self.messages(ex)
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = self._render(messages[:k], add_generation_prompt=True)
            through = self._render(messages[:k + 1], add_generation_prompt=False)
            tail = through[len(start):]
            ends = [i for i, t in enumerate(tail) if t in self.eos_ids]
            end = len(start) + (ends[0] + 1 if ends else len(tail))
            if through[:len(start)] == start and ids[:end] == through[:end]:
                mask[len(start):end] = [True] * (end - len(start))
        return ids, mask
