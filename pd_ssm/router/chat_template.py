"""Chat messages -> prompt text, through the model's Jinja chat template.

The template is the one the checkpoint ships (`chat_template` in tokenizer_config.json, or
chat_template.jinja; see engine/tokenizer.py), rendered the way transformers renders it:
sandboxed Jinja with `trim_blocks` / `lstrip_blocks`, variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, and a `raise_exception(msg)` function (a
template's way to refuse a conversation, e.g. roles that do not alternate: HTTP 400).

Models that ship no template (base models, the embedded default model) get `DEFAULT_CHAT_TEMPLATE`:

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>

one `<|role|>` line then the content per message, and with `add_generation_prompt` a final
`<|assistant|>` line for the model to continue.  BOS is not written by it: the tokenizer adds it.
"""

from __future__ import annotations

from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation or failed to render it (HTTP 400)."""


def _raise(message: str) -> NoReturn:
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, template: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
        env.globals["raise_exception"] = _raise
        self.source = template if template is not None else DEFAULT_CHAT_TEMPLATE
        self.is_default = template is None
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the model's chat template does not parse (line {e.lineno}): {e}") from e
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e
