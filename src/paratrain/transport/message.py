"""Typed messages: one frozen dataclass per message, its wire form derived from its fields, and
dispatch tables that hand a frame to its handler by op.

A message class is declared once, its op named where it subclasses `Message`:

    @dataclass(frozen=True, slots=True)
    class Barrier(Message, op="barrier"):
        group: str = "workers"
        name: str = ""
        data: Any = None

and travels as a frame's op and meta map (frame.py): `client.call(*msg.wire())` sends it,
`Barrier.from_meta(meta)` reads it back. The field types are read once per class, on its first
use, into the Python types the wire may carry for each field (msgpack gives int, float, str, bytes,
bool, list, dict, None), and an encoder and a decoder are made from them as straight-line code (as
dataclasses makes __init__): one store and one type test per field, no reflection per message.
Decoding a push's 13 fields costs about what msgpack's unpacking of that map does (3.9-6.6 us
against 3.4-3.7 us, on a loaded 2-core machine: take figures on a quiet one). A field whose
value is None is left out of the map (absent means None; a receiver reads an absent field as its
default); a class declared with `omit_defaults=True` leaves every field at its default out too, so
that the frames sent most carry only what they set (a push's `weight` of 1, its `more` of False).
A field typed as another message class travels as its map. Keys a receiver does not know are
ignored, so a sender may add an optional field before every receiver reads it.

A receiver keeps one `Routes` table: message class -> handler. `Routes.serve(request)` decodes a
request's meta into its class and calls `handler(request, msg)`; `Routes.route(op, meta, *context)`
does the same for one-way notices. A field of the wrong type is refused with a `MessageError` that
names the op, the field and the value; an op with no route is refused as unknown.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from paratrain.errors import ParatrainError


class MessageError(ParatrainError, ValueError):
    """A message whose fields do not match its type; the text names the op, field and value."""


M = TypeVar("M", bound="Message")
Field = tuple[str, "tuple[type, ...] | None", "Callable[[Any], Any] | None", bool, bool]
"""(name, the wire types it may carry (None: any), what turns the wire value into the field's
(None: itself), whether it is a nested message, whether it is required)."""

_NONE = type(None)
_WIRE_TYPES: dict[Any, tuple[type, ...]] = {
    int: (int,),
    float: (float, int),
    str: (str,),
    bool: (bool,),
    bytes: (bytes,),
    list: (list,),
    dict: (dict,),
}


class Message:
    """The base of every message class (a frozen dataclass); see the module docstring."""

    __slots__ = ()
    op: ClassVar[str] = ""
    omit_defaults: ClassVar[bool] = False
    """Fields at their defaults stay off the wire, as None does (the module docstring)."""

    def __init_subclass__(
        cls, op: str | None = None, omit_defaults: bool | None = None, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if op is not None:  # dataclass(slots=True) makes the class again, without the keywords
            cls.op = op
        if omit_defaults is not None:
            cls.omit_defaults = omit_defaults

    @classmethod
    def fields_spec(cls) -> tuple[Field, ...]:
        """The fields as the wire sees them (read once per class, with the codec made from them)."""
        return _codec(cls)[0]

    def to_meta(self) -> dict[str, Any]:
        return _codec(type(self))[2](self)

    def wire(self) -> tuple[str, dict[str, Any]]:
        """(op, meta): what RpcClient.call / send take."""
        return self.op, _codec(type(self))[2](self)

    @classmethod
    def from_meta(cls: type[M], meta: Mapping[str, Any]) -> M:
        return _codec(cls)[1](meta)


Codec = tuple[tuple[Field, ...], Callable[[Mapping[str, Any]], Any], Callable[[Any], dict[str, Any]]]
_CODECS: dict[type, Codec] = {}


def _codec(cls: type[Message]) -> Codec:
    """(fields, decode, encode) of a message class, made once: straight-line code per field, so a
    message costs one dict lookup, one type test and one store per field (dataclasses makes its
    __init__ the same way)."""
    codec = _CODECS.get(cls)
    if codec is None:
        codec = _CODECS[cls] = _compile(cls)
    return codec


def _compile(cls: type[Message]) -> Codec:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    spec = tuple((f.name, *_accepted(hints[f.name]), _required(f)) for f in fields)
    env: dict[str, Any] = {"cls": cls, "missing": _missing, "bad": _bad}
    decode, encode = ["def decode(meta):", "    get = meta.get"], ["def encode(self):", "    m = {}"]
    args = []
    for i, (f, (name, accepted, convert, nested, required)) in enumerate(zip(fields, spec, strict=True)):
        env[f"a{i}"], env[f"c{i}"], env[f"d{i}"] = accepted, convert, f.default
        env[f"f{i}"] = f.default_factory
        decode += [f"    v{i} = get({name!r})", f"    if v{i} is None:"]
        if required:
            decode.append(f"        raise missing(cls, {name!r})")
        elif f.default_factory is not dataclasses.MISSING:
            decode.append(f"        v{i} = f{i}()")
        else:
            decode.append(f"        v{i} = d{i}")
        if accepted is not None:
            decode += [f"    elif type(v{i}) not in a{i}:", f"        raise bad(cls, {name!r}, v{i}, a{i})"]
        if convert is not None:
            decode += ["    else:", f"        v{i} = c{i}(v{i})"]
        args.append(f"{name}=v{i}")
        omit = cls.omit_defaults and f.default is not dataclasses.MISSING and f.default is not None
        encode += [
            f"    v = self.{name}",
            f"    if v is not None and v != d{i}:" if omit else "    if v is not None:",
        ]
        encode.append(f"        m[{name!r}] = v.to_meta()" if nested else f"        m[{name!r}] = v")
    slots = [getattr(cls, f.name, None) for f in fields]  # a slot's descriptor, inherited or not
    if all(isinstance(slot, types.MemberDescriptorType) for slot in slots) and not hasattr(
        cls, "__post_init__"
    ):
        # A frozen dataclass's __init__ sets each field through object.__setattr__ (about half
        # the decode's time for a push's 13 fields): a slotted one's fields are set directly.
        env["new"] = object.__new__
        decode.append("    m = new(cls)")
        for i, slot in enumerate(slots):
            env[f"s{i}"] = slot.__set__  # type: ignore[union-attr]
            decode.append(f"    s{i}(m, v{i})")
        decode.append("    return m")
        _set_init(cls, fields, slots)
    else:
        decode.append(f"    return cls({', '.join(args)})")
    encode.append("    return m")
    exec("\n".join(decode + encode), env)  # noqa: S102 - code made above from field names only
    return spec, env["decode"], env["encode"]


_FACTORY: Any = object()  # a parameter's default: its field's default_factory makes the value


def _set_init(cls: type[Message], fields: tuple[dataclasses.Field, ...], slots: list) -> None:
    """Give a slotted message class an __init__ that sets each slot directly, with the dataclass's
    own signature (positional fields, then keyword-only ones, the same defaults). A frozen
    dataclass's sets each field through object.__setattr__: for a push's 13 fields that made
    building the message cost its sender about 1.8 us against 1.3 us so (a loaded 2-core machine),
    more than encoding it. Made with the codec, on the class's first use: the first messages are
    made by the dataclass's own __init__, alike."""
    if not all(f.init for f in fields):
        return
    env: dict[str, Any] = {"FACTORY": _FACTORY}
    positional: list[str] = []
    keywords: list[str] = []
    body: list[str] = []
    for i, (f, slot) in enumerate(zip(fields, slots, strict=True)):
        param = f.name
        if f.default is not dataclasses.MISSING:
            env[f"d{i}"], param = f.default, f"{f.name}=d{i}"
        elif f.default_factory is not dataclasses.MISSING:
            env[f"f{i}"], param = f.default_factory, f"{f.name}=FACTORY"
            body.append(f"    if {f.name} is FACTORY:\n        {f.name} = f{i}()")
        (keywords if f.kw_only else positional).append(param)
        env[f"s{i}"] = slot.__set__
        body.append(f"    s{i}(self, {f.name})")
    params = ["self", *positional, *(["*", *keywords] if keywords else [])]
    exec(f"def __init__({', '.join(params)}):\n" + "\n".join(body or ["    pass"]), env)  # noqa: S102
    env["__init__"].__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = env["__init__"]  # type: ignore[method-assign]


def _missing(cls: type[Message], name: str) -> MessageError:
    return MessageError(f"{cls.op!r} needs field {name!r}")


def _bad(cls: type[Message], name: str, value: Any, accepted: tuple[type, ...]) -> MessageError:
    return MessageError(f"{cls.op!r} field {name}={value!r} is not {_describe(accepted)}")


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _accepted(hint: Any) -> tuple[tuple[type, ...] | None, Callable[[Any], Any] | None, bool]:
    """(the wire types a field typed `hint` may carry, None: any; what converts the wire value;
    whether it is a nested message). A tuple travels as a list and is made a tuple again."""
    if hint is Any:
        return None, None, False
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    accepted: list[type] = []
    convert: Callable[[Any], Any] | None = None
    nested = False
    for arg in typing.get_args(hint) if union else (hint,):
        base = typing.get_origin(arg) or arg
        if arg is Any:
            return None, None, False
        if isinstance(arg, type) and issubclass(arg, Message):
            accepted.append(dict)
            convert, nested = arg.from_meta, True
        elif base is tuple:
            accepted += (list, tuple)
            convert = tuple
        elif base is _NONE:
            accepted.append(_NONE)
        elif base in _WIRE_TYPES:
            accepted += _WIRE_TYPES[base]
        else:
            raise TypeError(f"a message field of type {hint!r} has no wire form")
    return tuple(accepted), convert, nested


def _describe(accepted: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in accepted)


class Routes:
    """One receiver's dispatch table: op -> (message class, handler)."""

    def __init__(self, handlers: Mapping[type[Message], Callable[..., Any]]) -> None:
        self._table: dict[str, tuple[type[Message], Callable[..., Any]]] = {}
        for cls, handler in handlers.items():
            if cls.op in self._table:
                raise ValueError(f"two routes for op {cls.op!r}")
            cls.fields_spec()  # a field type without a wire form fails here, at start
            self._table[cls.op] = (cls, handler)

    @property
    def ops(self) -> frozenset[str]:
        return frozenset(self._table)

    def route(self, op: str, meta: Mapping[str, Any], *context: Any) -> bool:
        """Decode `meta` as `op`'s message and call its handler with `context` and the message;
        False where `op` has no route here."""
        entry = self._table.get(op)
        if entry is None:
            return False
        cls, handler = entry
        handler(*context, cls.from_meta(meta))
        return True

    def serve(self, request: Any) -> None:
        """A server's request (rpc.Request): to its handler, or refused as an unknown op."""
        if not self.route(request.op, request.meta, request):
            request.fail(f"unknown op {request.op!r}")
