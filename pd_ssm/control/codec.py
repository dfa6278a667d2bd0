"""The one serializer of control messages: dataclasses <-> msgpack bytes.

A registered dataclass travels as msgpack ext type `_EXT` whose payload is
`msgpack([tag, {field: value}])`; fields may hold plain msgpack values, lists / dicts of them, or
other registered dataclasses (nested to any depth: a `StepOutputs` carries `TokenDelta`s, a later
`Prefill` message can carry `SamplingParams` or a `Ticket`).  Decoding calls the class's
constructor, so a dataclass that validates itself in `__post_init__` validates what arrives too.
Nothing is ever unpickled: a frame can only build the classes the codec was given.

A `Codec` is built once from the tuple of classes a channel may carry (no module-level registry
to mutate): the disaggregated path adds its Reserve / Ticket / Prefill classes to that tuple.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import msgpack

_EXT = 1  # msgpack ext type code of a registered dataclass


class CodecError(ValueError):
    """Bytes that are not a control message this codec knows, or a value it cannot encode."""


class Codec:
    """Encodes / decodes instances of `types` (dataclasses), each under its `TAG` class attribute
    (or its class name when it has none).  Tags must be unique."""

    def __init__(self, types: Iterable[type]) -> None:
        self._by_tag: dict[str, type] = {}
        self._tag_of: dict[type, str] = {}
        for cls in types:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__} is not a dataclass; the control codec carries dataclasses only")
            tag = str(getattr(cls, "TAG", cls.__name__))
            if tag in self._by_tag:
                raise ValueError(f"tag {tag!r} is used by both {self._by_tag[tag].__name__} and {cls.__name__}")
            self._by_tag[tag] = cls
            self._tag_of[cls] = tag

    @property
    def types(self) -> tuple[type, ...]:
        return tuple(self._by_tag.values())

    def encode(self, msg: Any) -> bytes:
        if type(msg) not in self._tag_of:
            raise CodecError(f"{type(msg).__name__} is not a message type of this codec")
        try:
            return msgpack.packb(msg, default=self._default, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:  # a field msgpack cannot carry
            raise CodecError(f"cannot encode {type(msg).__name__}: {e}") from e

    def decode(self, data: bytes) -> Any:
        try:
            msg = msgpack.unpackb(data, ext_hook=self._ext_hook, raw=False, strict_map_key=False)
        except CodecError:
            raise
        except Exception as e:  # msgpack raises several types for truncated / garbage input
            raise CodecError(f"undecodable control message ({len(data)} bytes): {e}") from e
        if type(msg) not in self._tag_of:
            raise CodecError(f"a control message must be a registered dataclass, got {type(msg).__name__}")
        return msg

    # --- msgpack hooks -----------------------------------------------------------------------
    def _default(self, obj: Any) -> msgpack.ExtType:
        tag = self._tag_of.get(type(obj))
        if tag is None:
            raise TypeError(f"{type(obj).__name__} is neither a msgpack value nor a registered dataclass")
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return msgpack.ExtType(_EXT, msgpack.packb([tag, fields], default=self._default, use_bin_type=True))

    def _ext_hook(self, code: int, payload: bytes) -> Any:
        if code != _EXT:
            raise CodecError(f"unknown msgpack ext type {code}")
        body = msgpack.unpackb(payload, ext_hook=self._ext_hook, raw=False, strict_map_key=False)
        if not (isinstance(body, list) and len(body) == 2 and isinstance(body[0], str) and isinstance(body[1], dict)):
            raise CodecError("a dataclass frame must be [tag, {field: value}]")
        tag, fields = body
        cls = self._by_tag.get(tag)
        if cls is None:
            raise CodecError(f"unknown message tag {tag!r} (known: {sorted(self._by_tag)})")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = set(fields) - names
        if unknown:
            raise CodecError(f"{cls.__name__} has no field(s) {sorted(unknown)}: sender and receiver disagree")
        try:
            return cls(**fields)
        except (TypeError, ValueError) as e:  # a missing field, or the class's own validation
            raise CodecError(f"invalid {cls.__name__}: {e}") from e
