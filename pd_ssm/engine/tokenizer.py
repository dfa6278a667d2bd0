"""Tokenizers (HF `tokenizer.json`, or a byte-level fallback) and the streaming helpers.

`load_tokenizer` picks the tokenizer a model directory ships: `tokenizer.json` through the
`tokenizers` package (transformers is not needed at runtime), else `ByteTokenizer`.  A directory
that ships only a slow-tokenizer file (`tokenizer.model`, `vocab.json` + `merges.txt`) is refused
loudly rather than served with bytes.

`IncrementalDetokenizer` turns a stream of token ids into text deltas; `find_stop` finds stop
strings in the text it produces, looking only where a new match can be.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers

# NOTE: the byte block [byte_offset, byte_offset + 256) starts here unless a declared special id
# falls inside it; ids 0..2 stay free for pad / bos / eos, as in ByT5.
BYTE_OFFSET = 3
_NUM_BYTES = 256
_REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence ends with
_SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")


class TokenizerError(ValueError):
    """A tokenizer that cannot serve this model; the message says what to ship or change."""


class Tokenizer(ABC):
    """Text <-> ids for one model.

    `eos_token_ids`: ids that end generation (unless params.ignore_eos); `bos_token_id`: the id
    `encode` prepends when the tokenizer does so, else None; `vocab_size`: one past the largest id
    the tokenizer knows (never more than the model's vocab_size); `chat_template`: the Jinja
    template string as shipped, not rendered here.
    """

    eos_token_ids: list[int]
    bos_token_id: int | None
    vocab_size: int
    chat_template: str | None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Prompt ids, with the special tokens (BOS) the model expects."""

    @abstractmethod
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids the tokenizer does not know decode to nothing."""


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` plus what tokenizer_config.json adds to it.

    BOS: when the config sets `add_bos_token`, `encode` runs without the tokenizer.json
    post-processor and prepends BOS iff the flag is true (so a post-processor that also adds BOS
    cannot double it); without the flag, the post-processor decides, as transformers does.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: list[int],
        bos_token_id: int | None,
        add_bos_token: bool | None,
        chat_template: str | None,
    ) -> None:
        if add_bos_token and bos_token_id is None:
            raise TokenizerError(
                "tokenizer_config.json sets add_bos_token but names no bos_token known to the vocab"
            )
        self._backend = backend
        self._add_bos = add_bos_token
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        if self._add_bos is None:
            return self._backend.encode(text).ids
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self._add_bos else ids  # type: ignore[list-item]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


def byte_offset(special_ids: Iterable[int]) -> int:
    """The first id of the byte block: the lowest offset >= BYTE_OFFSET whose 256 ids hold no special id."""
    offset = BYTE_OFFSET
    for s in sorted(set(special_ids)):  # ascending: a special inside the window pushes it past itself
        if offset <= s < offset + _NUM_BYTES:
            offset = s + 1
    return offset


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids, for models that ship no tokenizer (tests, byte-level models).

    Scheme: byte `b` is id `byte_offset + b`.  `byte_offset` is `BYTE_OFFSET` (3) unless a special
    id the config declares (bos, eos) falls in [3, 259), in which case the block moves to the first
    256-id window past the specials (`byte_offset()`); the model's vocab_size must reach
    `byte_offset + 256`.  `encode` prepends BOS only when `add_bos` is set.  `decode` drops every id
    outside the byte block (special tokens have no text) and decodes invalid UTF-8 with U+FFFD.
    """

    def __init__(
        self, *, vocab_size: int, eos_token_ids: list[int], bos_token_id: int | None, add_bos: bool = False
    ) -> None:
        specials = [*eos_token_ids, *([] if bos_token_id is None else [bos_token_id])]
        self.byte_offset = byte_offset(specials)
        if vocab_size < self.byte_offset + _NUM_BYTES:
            raise TokenizerError(
                f"the byte-level fallback tokenizer puts bytes at ids [{self.byte_offset}, "
                f"{self.byte_offset + _NUM_BYTES}) (after special ids {sorted(set(specials))}), but the "
                f"model's vocab_size is {vocab_size}; ship a tokenizer.json with the model"
            )
        if add_bos and bos_token_id is None:
            raise TokenizerError("add_bos needs a bos_token_id")
        self._add_bos = add_bos
        self.eos_token_ids = list(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.vocab_size = max([self.byte_offset + _NUM_BYTES, *(s + 1 for s in specials)])
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        ids = [self.byte_offset + b for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if self._add_bos else ids  # type: ignore[list-item]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        lo = self.byte_offset
        data = bytes(i - lo for i in ids if lo <= i < lo + _NUM_BYTES)
        return data.decode("utf-8", errors="replace")


def load_tokenizer(
    model_dir: Path, *, vocab_size: int, eos_token_ids: list[int], bos_token_id: int | None
) -> Tokenizer:
    """The tokenizer `model_dir` ships; `vocab_size`, `eos_token_ids`, `bos_token_id` come from the model config.

    EOS ids are the config's, plus the tokenizer's `eos_token` when it names another; BOS is the
    tokenizer's `bos_token` when it names one, else the config's.  Every id must be < vocab_size.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        slow = [f for f in _SLOW_TOKENIZER_FILES if (model_dir / f).is_file()]
        if slow:
            raise TokenizerError(
                f"{model_dir} ships {', '.join(slow)} but no tokenizer.json; convert it once with "
                "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
            )
        return ByteTokenizer(vocab_size=vocab_size, eos_token_ids=eos_token_ids, bos_token_id=bos_token_id)
    tok = _load_hf(model_dir, eos_token_ids=eos_token_ids, bos_token_id=bos_token_id)
    if tok.vocab_size > vocab_size:
        raise TokenizerError(
            f"{model_dir}/tokenizer.json knows ids up to {tok.vocab_size - 1} but the model's vocab_size "
            f"is {vocab_size}: the tokenizer does not belong to this model"
        )
    return tok


def _load_hf(model_dir: Path, *, eos_token_ids: list[int], bos_token_id: int | None) -> HFTokenizer:
    backend = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config_path = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
    _mark_special(backend, _special_token_names(config))

    def token_id(key: str) -> int | None:
        name = _token_content(config.get(key))
        return None if name is None else backend.token_to_id(name)

    eos_ids = list(eos_token_ids)
    tok_eos = token_id("eos_token")
    if tok_eos is not None and tok_eos not in eos_ids:
        eos_ids.append(tok_eos)
    tok_bos = token_id("bos_token")
    add_bos = config.get("add_bos_token")
    return HFTokenizer(
        backend,
        eos_token_ids=eos_ids,
        bos_token_id=tok_bos if tok_bos is not None else bos_token_id,
        add_bos_token=None if add_bos is None else bool(add_bos),
        chat_template=_chat_template(model_dir, config),
    )


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_token_names(config: dict[str, Any]) -> list[str]:
    keys = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
    values: list[Any] = [config.get(k) for k in keys]
    for key in ("additional_special_tokens", "extra_special_tokens"):  # transformers 4 / 5 names
        extra = config.get(key) or []
        values.extend(extra.values() if isinstance(extra, dict) else extra)
    values.extend(v for v in (config.get("added_tokens_decoder") or {}).values() if v.get("special"))
    return [n for n in map(_token_content, values) if n is not None]


def _mark_special(backend: tokenizers.Tokenizer, names: list[str]) -> None:
    """Mark the config's special tokens special in the backend, so decode can skip them (as transformers does).

    Only tokens already in the vocab: transformers would grow the vocab with unknown ones, which
    would give ids the model has no logits for.
    """
    already = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    new = [n for n in dict.fromkeys(names) if n not in already and backend.token_to_id(n) is not None]
    if new:
        backend.add_special_tokens([tokenizers.AddedToken(n, special=True, normalized=False) for n in new])


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str):
        return template
    jinja = model_dir / "chat_template.jinja"  # where transformers >= 4.43 saves it
    return jinja.read_text() if jinja.is_file() else None


class IncrementalDetokenizer:
    """Text deltas from token ids fed one at a time, for streaming and stop strings.

    The prefix-offset / read-offset technique: ids[prefix:read] were already turned into text;
    each step decodes the window ids[prefix:] and returns what it adds to the decoding of
    ids[prefix:read].  Decoding a window rather than the lone new id keeps tokenizer context
    (leading spaces); a window ending in U+FFFD is held back, because its last token may be the
    first bytes of a multi-byte character.  For byte-level tokenizers the deltas, plus `flush()`,
    concatenate to `decode(all ids)`.

    `prompt_ids`: the last `context` of them seed the window so the first generated token decodes
    in context; they are never returned as text.  `text` is everything returned so far.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        context: int = 5,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-context:]) if prompt_ids and context > 0 else []
        # NOTE: self._ids is the window ids[prefix:]; ids[prefix:prefix + read] are already text
        self._read = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """The text `token_id` completes; "" while a character is still incomplete."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The held-back text (incomplete characters as U+FFFD), once the request has finished."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        done = self._decode(self._ids[: self._read])
        full = self._decode(self._ids)
        if len(full) <= len(done) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        delta = full[len(done) :]
        # the next window starts at this one's read offset: a character boundary, as it was emitted
        del self._ids[: self._read]
        self._read = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


def find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Index in `text` where the earliest stop string begins, or None.

    `start`: how much of `text` was searched before (its length before the newest delta), known
    to hold no complete stop string; only matches that end past `start` are looked for, so stop
    `s` is searched from `start - len(s) + 1`.
    """
    best: int | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
