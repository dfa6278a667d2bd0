from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pd_ssm.engine.tokenizer import (
    BYTE_OFFSET,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    TokenizerError,
    byte_offset,
    find_stop,
    load_tokenizer,
)

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mamba is a selective state space model; hybrids interleave attention layers.",
    "héllo wörld, ça va? naïve café — déjà vu",
    "日本語のテキストと中文文本 and emoji 🙂🚀",
    "def f(x):\n    return x * 2  # code\n",
] * 20
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _backend(bos_post_processor: bool = False) -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


@pytest.fixture(scope="module")
def backend() -> BackendTokenizer:
    return _backend()


def _model_dir(tmp_path: Path, backend: BackendTokenizer, config: dict | None) -> Path:
    backend.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def _load(model_dir: Path, vocab_size: int = 512, eos: list[int] | None = None, bos: int | None = None):
    return load_tokenizer(model_dir, vocab_size=vocab_size, eos_token_ids=eos or [], bos_token_id=bos)


# ---- HFTokenizer


def test_hf_round_trip_with_config(tmp_path, backend):
    config = {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    tok = _load(_model_dir(tmp_path, backend, config), eos=[0])
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == [0, 2]  # the model config's first, then the tokenizer's
    assert tok.chat_template == TEMPLATE
    assert tok.vocab_size == backend.get_vocab_size()
    for text in CORPUS[:5] + ["unseen wörds ✓ 𝄞", ""]:
        ids = tok.encode(text)
        assert ids[0] == 1 and ids.count(1) == 1
        assert tok.decode(ids) == text
    assert tok.decode([1, *tok.encode("hi")[1:], 2], skip_special_tokens=False) == "<s>hi</s>"


def test_hf_add_bos_does_not_double_a_post_processor_bos(tmp_path):
    backend = _backend(bos_post_processor=True)
    tok = _load(_model_dir(tmp_path, backend, {"add_bos_token": True, "bos_token": "<s>"}))
    assert tok.encode("fox")[0] == 1 and tok.encode("fox").count(1) == 1
    tok_off = _load(_model_dir(tmp_path, backend, {"add_bos_token": False, "bos_token": "<s>"}))
    assert 1 not in tok_off.encode("fox")


def test_hf_without_config_follows_post_processor(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = _load(_model_dir(tmp_path / "a", _backend(), None), eos=[2], bos=1)
    assert plain.encode("fox")[0] != 1 and plain.bos_token_id == 1 and plain.eos_token_ids == [2]
    assert plain.chat_template is None
    with_bos = _load(_model_dir(tmp_path / "b", _backend(bos_post_processor=True), None))
    assert with_bos.encode("fox")[0] == 1


def test_hf_config_token_forms_and_template_file(tmp_path, backend):
    config = {
        "eos_token": {"content": "</s>", "lstrip": False, "__type": "AddedToken"},
        "bos_token": None,
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    }
    tok = _load(_model_dir(tmp_path, backend, config), bos=1)
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1 and tok.chat_template == "D"
    del config["chat_template"]
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    assert _load(_model_dir(tmp_path, backend, config)).chat_template == TEMPLATE


def test_hf_config_special_tokens_are_skipped_in_decode(tmp_path):
    backend = BackendTokenizer(
        models.WordLevel({"hello": 0, "world": 1, "<eot>": 2, "[UNK]": 3}, unk_token="[UNK]")
    )
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    tok = _load(_model_dir(tmp_path, backend, {"eos_token": "<eot>"}), vocab_size=4)
    assert tok.encode("hello world") == [0, 1]
    assert tok.decode([0, 1, 2]) == "hello world"  # <eot> became special though tokenizer.json did not say so
    assert tok.eos_token_ids == [2]


def test_hf_vocab_larger_than_model_raises(tmp_path, backend):
    with pytest.raises(TokenizerError, match="vocab_size"):
        _load(_model_dir(tmp_path, backend, None), vocab_size=100)


def test_slow_tokenizer_only_raises(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        _load(tmp_path)


def test_add_bos_without_bos_token_raises(tmp_path, backend):
    with pytest.raises(TokenizerError, match="add_bos_token"):
        _load(_model_dir(tmp_path, backend, {"add_bos_token": True}))


# ---- ByteTokenizer


def test_missing_tokenizer_falls_back_to_bytes(tmp_path):
    tok = _load(tmp_path, vocab_size=300, eos=[2], bos=1)
    assert isinstance(tok, ByteTokenizer)
    assert tok.byte_offset == BYTE_OFFSET == 3
    assert tok.encode("A") == [3 + 65] and tok.vocab_size == 259
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1 and tok.chat_template is None


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trips_unicode(text):
    tok = ByteTokenizer(vocab_size=259, eos_token_ids=[0], bos_token_id=1, add_bos=True)
    ids = tok.encode(text)
    assert ids[0] == 1 and all(3 <= i < 259 for i in ids[1:])
    assert tok.decode(ids) == text


def test_byte_offset_leaves_room_for_specials():
    assert byte_offset([]) == byte_offset([0, 1, 2]) == BYTE_OFFSET
    assert byte_offset([0, 5]) == 6
    assert byte_offset([5, 100, 300]) == 301  # each special inside the window pushes it further
    assert byte_offset([50256]) == BYTE_OFFSET  # specials at the end of a large vocab do not move it
    tok = ByteTokenizer(vocab_size=600, eos_token_ids=[7], bos_token_id=None)
    assert tok.byte_offset == 8 and tok.decode([7, 8 + 104, 8 + 105]) == "hi"


def test_byte_vocab_too_small_raises():
    with pytest.raises(TokenizerError, match="vocab_size"):
        ByteTokenizer(vocab_size=258, eos_token_ids=[0], bos_token_id=1)
    with pytest.raises(TokenizerError, match=r"\[11, 267\)"):
        ByteTokenizer(vocab_size=266, eos_token_ids=[10], bos_token_id=None)


def test_byte_decode_ignores_non_bytes_and_replaces_invalid_utf8():
    tok = ByteTokenizer(vocab_size=1000, eos_token_ids=[2], bos_token_id=1)
    assert tok.decode([1, 3 + ord("a"), 2, 999, 3 + 0xFF, 3 + ord("b")]) == "a\ufffdb"


# ---- IncrementalDetokenizer


def _stream(tok, ids: list[int], prompt_ids: list[int] | None = None) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.add(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def test_detokenizer_holds_back_split_character():
    tok = ByteTokenizer(vocab_size=259, eos_token_ids=[0], bos_token_id=None)
    deltas, tail = _stream(tok, tok.encode("a€b"))  # € is 3 bytes
    assert deltas == ["a", "", "", "€", "b"] and tail == ""
    deltas, tail = _stream(tok, tok.encode("a€")[:-1])  # generation stopped mid-character
    assert deltas == ["a", "", ""] and tail == "\ufffd"


@settings(max_examples=200, deadline=None)
@given(st.text(), st.lists(st.integers(0, 300), max_size=30))
def test_detokenizer_bytes_concat_equals_decode(text, noise):
    tok = ByteTokenizer(vocab_size=301, eos_token_ids=[0], bos_token_id=1)
    deltas, tail = _stream(tok, tok.encode(text))
    # NOTE: literal U+FFFDs at the very end look like an unfinished character until the end: they
    # come out of flush() (hypothesis found text='\ufffd'); everything else comes out as deltas
    held = text[len(text.rstrip("\ufffd")):]
    assert "".join(deltas) + tail == text and tail == held
    # arbitrary ids: invalid UTF-8, specials, ids past the byte block
    ids = tok.encode(text) + noise
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_detokenizer_bpe_concat_equals_decode(backend, text):
    tok = HFTokenizer(backend, eos_token_ids=[2], bos_token_id=1, add_bos_token=False, chat_template=None)
    ids = tok.encode(text)
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == text


def test_detokenizer_bpe_splits_multibyte_across_tokens(backend):
    tok = HFTokenizer(backend, eos_token_ids=[2], bos_token_id=1, add_bos_token=False, chat_template=None)
    ids = tok.encode("x𝄞y")  # a 4-byte character the BPE never saw: one token per byte
    assert len(ids) >= 4
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) == "x𝄞y" and "\ufffd" not in "".join(deltas) and tail == ""


def test_detokenizer_prompt_context_is_not_emitted(backend):
    tok = HFTokenizer(backend, eos_token_ids=[2], bos_token_id=1, add_bos_token=False, chat_template=None)
    prompt, output = tok.encode("The quick brown"), tok.encode(" fox jumps")
    deltas, _ = _stream(tok, output, prompt_ids=prompt)
    assert "".join(deltas) == " fox jumps"  # the leading space survives thanks to the context
    deltas, _ = _stream(tok, [2, *output, 2], prompt_ids=prompt)  # specials decode to nothing
    assert "".join(deltas) == " fox jumps"


# ---- find_stop


def test_find_stop():
    assert find_stop("hello world", ["wor"], 0) == 6
    assert find_stop("hello world", ["xyz"], 0) is None
    assert find_stop("hello world", [], 0) is None
    assert find_stop("ab STOP cd END", ["END", "STOP"], 0) == 3  # the earliest, not the first listed
    # a stop split across deltas: "hello wo" was searched, "rld" is new
    assert find_stop("hello world", ["wor"], len("hello wo")) == 6
    # matches wholly inside the searched text are not looked for again
    assert find_stop("wor then more", ["wor"], len("wor then")) is None
    assert find_stop("abcabc", ["abc"], 4) == 3


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(alphabet="abc", max_size=4), min_size=1, max_size=8),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_find_stop_incremental_equals_full_search(deltas, stops):
    """Searching each new delta finds the same first stop as searching the whole text at once."""
    text, found = "", None
    for delta in deltas:
        start, text = len(text), text + delta
        found = find_stop(text, stops, start)
        if found is not None:
            break
    full = [i for i in (text.find(s) for s in stops) if i != -1]
    assert found == (min(full) if full else None)
