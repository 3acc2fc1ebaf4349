"""A model of this cluster in the `tinker-cookbook`'s own registries, so that its drivers and recipes take it by
name: `register(name, folder)` registers the model's tokenizer (read from its folder, as the SDK's
`get_tokenizer` does through `get_info`) under the SDK's model name, and `PlainChatRenderer` under
`RENDERER`.

`PlainChatRenderer` is for rlserve's generated models, which have no chat format of their own that the
cookbook knows: `role: content` turns, each assistant turn ended by the tokenizer's EOS token (its stop
token); text is lowercased for a tokenizer without capitals (the `tiny` preset's characters).

The cookbook is a test extra (requirements/tinker-cookbook.txt): import this module only where it is.
"""

from __future__ import annotations

from pathlib import Path

import tinker
from tinker_cookbook import renderers, tokenizer_utils
from tinker_cookbook.renderers.base import Message, ParseTermination, RenderContext, RenderedMessage, ensure_text
from tinker_cookbook.renderers.role_colon import RoleColonRenderer

RENDERER = "rlserve/plain_chat"


class PlainChatRenderer(RoleColonRenderer):
    """`role: content` turns; an assistant turn ends with EOS, which stops sampling."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab()
        self._lower = "A" not in vocab and "a" in vocab  # a character vocabulary without capitals
        if tokenizer.eos_token_id is None:
            raise ValueError(f"{RENDERER} needs a tokenizer with an EOS token")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text.lower() if self._lower else text, add_special_tokens=False))

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        end = [self.tokenizer.eos_token_id] if message["role"] == "assistant" else self._encode("\n")
        output = self._encode(" " + ensure_text(message["content"])) + end
        return RenderedMessage(header=tinker.types.EncodedTextChunk(tokens=self._encode(f"{message['role']}:")),
                               output=[tinker.types.EncodedTextChunk(tokens=output)])

    def get_stop_sequences(self) -> list[int]:
        return [self.tokenizer.eos_token_id]

    def parse_response(self, response: list[int]) -> tuple[Message, ParseTermination]:
        stopped = bool(response) and response[-1] == self.tokenizer.eos_token_id
        text = str(self.tokenizer.decode(response[:-1] if stopped else response, skip_special_tokens=True))
        return (Message(role="assistant", content=text.strip()),
                ParseTermination.STOP_SEQUENCE if stopped else ParseTermination.MALFORMED)


def register(name: str, folder: Path) -> None:
    """`name` (the SDK's model name on this cluster) loads its tokenizer from `folder`; the renderer is
    `RENDERER`."""
    from transformers import AutoTokenizer

    tokenizer_utils.register_tokenizer(name, lambda: AutoTokenizer.from_pretrained(folder))
    tokenizer_utils.register_tokenizer(str(folder), lambda: AutoTokenizer.from_pretrained(folder))
    renderers.register_renderer(RENDERER, lambda tokenizer, image_processor=None: PlainChatRenderer(tokenizer))
