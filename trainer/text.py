"""Between text and token ids, the one way: prompts get the model's BOS, completions end at the first stop token.

Every place that turns a completion into text (reward recomputation, evaluation, the lockstep baseline) calls
``completion_text``, so a completion means the same thing to all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def completion_text(ids: Sequence[int], eos_ids: Sequence[int], decode: Callable[[list[int]], str]) -> str:
    """The text a completion means: its tokens up to (not including) the first stop token."""
    end = next((k for k, t in enumerate(ids) if t in eos_ids), len(ids))
    return decode(list(ids[:end]))


class TextCodec:
    """A tokenizer seen as the swarm uses it: prompt text -> ids, completion ids -> text.

    ``eos_ids`` are the model directory's stop tokens (trainer/model_dir.py), the same ones every engine stops
    on. With ``chat_template`` a prompt is rendered as one user turn with the generation prompt appended, which
    carries its own special tokens; without it, the prompt is BOS (if the model has one) + the text.
    """

    def __init__(self, tokenizer: Any, eos_ids: tuple[int, ...], chat_template: bool = False) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.bos_id: int | None = tokenizer.bos_token_id
        self.chat_template = chat_template
        if chat_template and not getattr(tokenizer, "chat_template", None):
            from trainer.errors import UserError

            raise UserError("--chat-template: this model's tokenizer has no chat template")

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat_template:
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer.encode(rendered, add_special_tokens=False))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ([self.bos_id] if self.bos_id is not None else []) + list(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def completion_text(self, ids: Sequence[int]) -> str:
        return completion_text(ids, self.eos_ids, self.decode)
