"""PromptBuilder: what the router turns a request's prompt or messages into (token ids).

The router tokenizes (DESIGN: workers receive ids), with the tokenizer the checkpoint ships
(engine/tokenizer.py, loaded without the weights) and its chat template (chat_template.py).
Token-id prompts are checked against the model's vocabulary here so the error names `prompt`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pd_ssm.config import ModelConfig
from pd_ssm.engine.tokenizer import Tokenizer, load_tokenizer
from pd_ssm.router.chat_template import ChatTemplate


class PromptError(ValueError):
    """A prompt the model cannot take; `param` is the request field to fix."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.template = template

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PromptBuilder:
        mc = ModelConfig.from_pretrained(model_dir)
        tok = load_tokenizer(Path(model_dir), vocab_size=mc.vocab_size, eos_token_ids=mc.eos_token_ids,
                             bos_token_id=mc.bos_token_id)

        def text_of(token_id: int | None) -> str:
            return "" if token_id is None else tok.decode([token_id], skip_special_tokens=False)

        eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
        template = ChatTemplate(tok.chat_template, bos_token=text_of(tok.bos_token_id), eos_token=text_of(eos))
        return cls(tok, mc.vocab_size, template)

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise PromptError(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                                  "prompt")
            ids = list(prompt)
        if not ids:
            raise PromptError("prompt: it tokenizes to no tokens", "prompt")
        return ids

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = self.template.render(messages, add_generation_prompt)
        ids = self.tokenizer.encode(text)
        bos = self.tokenizer.bos_token_id
        # a template that writes {{ bos_token }} and a tokenizer that prepends BOS would double it;
        # transformers avoids that by not adding special tokens to rendered chats
        if bos is not None and ids[:2] == [bos, bos]:
            ids = ids[1:]
        if not ids:
            raise PromptError("messages: the chat template rendered them to no tokens", "messages")
        return ids
