"""The one codec of the worker contract: its records are msgspec declarations, and
`from_json` / `decode` / `to_json` / `encode` are the only code that reads or writes them.

Every record is a frozen `Record` (a `msgspec.Struct`). Field types carry the rules:
`Meta` bounds (checked when decoding), `Literal`s and enums (sent as their values), and the
hex types below; a record's `__post_init__` holds what spans fields. Keys and namespaces
are `bytes` in Python and lowercase hex on the wire (a `HexRecord` turns the plain bytes it
is given into `Hex`, which the codec writes as hex: msgspec writes bytes as base64).
"""

from __future__ import annotations

import sys
import types
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, Union, get_args, get_origin, overload

import msgspec
import numpy as np
import orjson

KEY_BYTES = 16


class WireError(ValueError):
    """A record on the wire is malformed (the receiving side answers 400)."""


if TYPE_CHECKING:  # plain bytes to the type checker; the subclasses below tell msgspec
    Hex = bytes
    Key = bytes
else:
    class Hex(bytes):
        """Bytes sent as hex (a namespace: any length)."""

        __slots__ = ()

    class Key(Hex):
        """An anchor key: `KEY_BYTES` bytes, sent as hex."""

        __slots__ = ()


class TokenIds(Sequence[int]):
    """Token ids held as native int64 bytes (`buf`: what anchor keys hash), not as Python
    ints; the codec writes them as the JSON list of ints an `Ids` field carries.

    A long prompt's ids as a tuple cost the proxy a turn's worth of CPU by themselves: a
    100k-token prompt's tuple is 100k references to touch (1-2 ms, cache-cold, each turn),
    its JSON another ms. Its bytes are the prior turn's and the new tokens' (one copy), and
    the codec writes them from the buffer (orjson over a numpy view of it). Immutable; equal
    to any tuple or list of the same ints (a slice is a tuple). `json`: their JSON text
    where the maker has it (the splitter extends a kept turn's as it extends its bytes:
    proxy/splitter/turns.py), written as it is; else the codec makes it."""

    __slots__ = ("buf", "json")

    def __init__(self, buf: bytes, json: bytes | None = None) -> None:
        if len(buf) % 8:
            raise ValueError("token ids are 8 bytes each")
        self.buf, self.json = buf, json

    @classmethod
    def of(cls, ids: Iterable[int]) -> TokenIds:
        return ids if isinstance(ids, TokenIds) else cls(array("q", ids).tobytes())

    def __len__(self) -> int:
        return len(self.buf) >> 3

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...
    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        view = memoryview(self.buf).cast("q")
        return tuple(view[i].tolist()) if isinstance(i, slice) else view[i]

    def __iter__(self) -> Iterator[int]:
        return iter(memoryview(self.buf).cast("q").tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self.buf == other.buf
        if isinstance(other, tuple | list):
            return len(other) == len(self) and self[:] == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self[:])  # as the equal tuple's

    def __add__(self, other: Sequence[int]) -> TokenIds:
        return self if not other else TokenIds(self.buf + TokenIds.of(other).buf)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        view = np.frombuffer(self.buf, np.int64)  # read-only: no copy
        return view if dtype is None else view.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"TokenIds({self[:]!r})"


_FMAX = sys.float_info.max
Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Depth = Annotated[int, msgspec.Meta(ge=1)]  # a prefix length
Finite = Annotated[float, msgspec.Meta(ge=-_FMAX, le=_FMAX)]  # JSON has no NaN or infinity
Epoch = Annotated[str, msgspec.Meta(min_length=1)]  # the worker's id of its process start
Ids = tuple[Int64, ...]  # token ids, depths, slots: 64-bit integers


class Record(msgspec.Struct, frozen=True, gc=False):
    """A record of the contract (no record can hold a reference cycle: gc=False)."""

    def to_json(self) -> dict[str, Any]:
        return to_json(self)

    @classmethod
    def from_json(cls: type[R], obj: Any) -> R:
        return from_json(cls, obj)


R = TypeVar("R", bound=Record)
T = TypeVar("T")


class HexRecord(Record, frozen=True):
    """A record with fields of a `Hex` type (`Key`, `Key | None`, `tuple[Key, ...]`, ...)."""

    def __post_init__(self) -> None:
        found = _HEX_FIELDS.get(type(self))
        if found is None:
            found = _HEX_FIELDS[type(self)] = _hex_fields(type(self))
        for name, tp, many in found:
            value = getattr(self, name)
            if many:
                if any(type(v) is not tp for v in value):
                    msgspec.structs.force_setattr(self, name, tuple(tp(v) for v in value))
            elif value is not None and type(value) is not tp:
                msgspec.structs.force_setattr(self, name, tp(value))


_HEX_FIELDS: dict[type, tuple[tuple[str, type, bool], ...]] = {}


def _hex_fields(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """(name, its Hex type, a tuple of them) of each Hex field of the record `cls`."""
    out = []
    for f in msgspec.structs.fields(cls):
        tp, many = f.type, get_origin(f.type) is tuple
        if many:
            tp = get_args(tp)[0]
        options = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)
        out += [(f.name, t, many) for t in options if isinstance(t, type) and issubclass(t, Hex)]
    return tuple(out)


def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is Key or tp is Hex:
        if not isinstance(obj, str):
            raise TypeError("expected a hex string")
        value = tp.fromhex(obj)
        if tp is Key and len(value) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes of hex, not {len(value)}")
        return value
    raise NotImplementedError(tp)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, Hex):
        return obj.hex()
    if isinstance(obj, TokenIds):
        return msgspec.Raw(obj.json if obj.json is not None else orjson.dumps(
            np.frombuffer(obj.buf, np.int64), option=orjson.OPT_SERIALIZE_NUMPY))
    raise TypeError(f"{type(obj).__name__} is not a wire type")


def _wire_error(e: msgspec.DecodeError, record: str = "", field: str = "") -> WireError:
    """msgspec's message, its path (`$.a.b[0]`) turned into the field's name."""
    message, at, path = str(e).partition(" - at `$")
    path = field + path.rstrip("`") if at else field
    where = f"'{path.lstrip('.')}': " if path else ""
    return WireError(f"{record}: {where}{message}" if record else f"{where}{message}")


def convert(tp: Any, obj: Any, field: str) -> Any:
    """The value `obj` (parsed JSON) of a field as the type `tp`; WireError naming it."""
    try:
        return msgspec.convert(obj, tp, dec_hook=_dec_hook)
    except msgspec.ValidationError as e:
        raise _wire_error(e, field=field) from None


def from_json(cls: type[T], obj: Any) -> T:
    """The record `cls` read from parsed JSON (a dict); WireError when it is malformed."""
    try:
        return msgspec.convert(obj, cls, dec_hook=_dec_hook)
    except msgspec.ValidationError as e:
        raise _wire_error(e, record=cls.__name__) from None


def decode(raw: bytes, cls: type[T]) -> T:
    """The record `cls` read from JSON text; WireError for bad JSON or a malformed record."""
    try:
        return msgspec.json.decode(raw, type=cls, dec_hook=_dec_hook)
    except msgspec.DecodeError as e:
        raise _wire_error(e, record=cls.__name__) from None


def encode(record: Any) -> bytes:
    """JSON text of a record (or of builtins holding records)."""
    return msgspec.json.encode(record, enc_hook=_enc_hook)


def to_json(record: Any) -> dict[str, Any]:
    """A record as the JSON object the wire carries (lists, hex strings, enum values)."""
    out: dict[str, Any] = msgspec.json.decode(encode(record))
    return out


def parse_ids(value: Any, name: str) -> tuple[int, ...]:
    """A JSON list of 64-bit integers (token ids, depths), else WireError."""
    ids: tuple[int, ...] = convert(Ids, value, name)
    return ids
