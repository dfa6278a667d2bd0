"""Chat templates: the documented default, a shipped HF-style template, and its refusals."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest

from pd_ssm.default_model import write_checkpoint
from pd_ssm.router.chat_template import ChatTemplate, ChatTemplateError
from pd_ssm.router.prompts import PromptBuilder, PromptError

# the shape of many HF templates: BOS, role checks through raise_exception, a generation prompt
HF_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _words(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_letters + " ") for _ in range(rng.randint(1, 30)))


def test_default_template_is_as_documented() -> None:
    rng = random.Random()
    msgs = [{"role": r, "content": _words(rng)} for r in ("system", "user", "assistant", "user")]
    out = ChatTemplate(None).render(msgs)
    assert out == "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs) + "<|assistant|>\n"
    assert ChatTemplate(None).render(msgs, add_generation_prompt=False).endswith(msgs[-1]["content"] + "\n")


def test_shipped_template_and_its_refusals() -> None:
    t = ChatTemplate(HF_STYLE, bos_token="<s>", eos_token="</s>")
    out = t.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                    {"role": "user", "content": "?"}])
    assert out == "<s>[user] hi</s>\n[assistant] yo</s>\n[user] ?</s>\n[assistant] "
    with pytest.raises(ChatTemplateError, match="alternate"):
        t.render([{"role": "assistant", "content": "first"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")


def test_sandbox_refuses_unsafe_templates() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(evil).render([{"role": "user", "content": "x"}])


def _word_level_tokenizer(path: Path, words: list[str]) -> None:
    """A tokenizer.json (word level, whitespace split) with <s>, </s> and [user] / [assistant] marks."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "[", "]", "user", "assistant", "?", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.save(str(path / "tokenizer.json"))


def test_prompt_builder_uses_the_shipped_template_without_doubling_bos(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)  # the default model's config: vocab 512, bos 1, eos 2
    plain = PromptBuilder.from_model_dir(tmp_path)
    assert plain.template.is_default  # byte tokenizer, no template shipped
    rng = random.Random()
    ids = [rng.randrange(3, 259) for _ in range(rng.randint(1, 20))]
    assert plain.completion_ids(ids) == ids
    assert plain.completion_ids("abc") == plain.tokenizer.encode("abc")
    with pytest.raises(PromptError, match="outside the vocabulary") as e:
        plain.completion_ids([*ids, 10_000])
    assert e.value.param == "prompt"

    words = sorted({"".join(rng.choice(string.ascii_lowercase) for _ in range(5)) for _ in range(8)})
    _word_level_tokenizer(tmp_path, words)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": HF_STYLE, "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    shipped = PromptBuilder.from_model_dir(tmp_path)
    assert not shipped.template.is_default
    msgs = [{"role": "user", "content": " ".join(rng.sample(words, 3))}]
    got = shipped.chat_ids(msgs)
    vocab_of = shipped.tokenizer.decode
    assert got[0] == 1 and got[1] != 1  # one BOS: the template's, not a second from the tokenizer
    assert vocab_of(got, skip_special_tokens=False).split() == ["<s>", "[", "user", "]", *msgs[0]["content"].split(),
                                                                "</s>", "[", "assistant", "]"]
