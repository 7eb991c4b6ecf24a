"""Typed messages (transport/message.py) and the protocols built on them: each message's wire form
round-trips, a field of the wrong type is refused naming op, field and value, and a receiver's table
routes every op it declares (no processes)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

from paratrain.cluster import protocol as cluster
from paratrain.transport.message import Message, MessageError, Routes


@dataclass(frozen=True, slots=True)
class Inner(Message, op="inner"):
    a: int


@dataclass(frozen=True, slots=True)
class Sample(Message, op="sample"):
    name: str
    n: int = 0
    x: float = 0.0
    data: Any = None
    inner: Inner | None = None
    ranks: tuple[int, ...] = ()


def test_a_message_round_trips_through_msgpack_as_its_op_and_meta():
    sent = Sample("s", 3, 1.5, {"k": [1, 2]}, Inner(2), (4, 5))
    op, meta = sent.wire()
    assert op == "sample"
    assert meta == {"name": "s", "n": 3, "x": 1.5, "data": {"k": [1, 2]}, "inner": {"a": 2}, "ranks": (4, 5)}
    got = Sample.from_meta(msgpack.unpackb(msgpack.packb(meta), raw=False))
    assert got == sent and isinstance(got.ranks, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.name = "t"  # type: ignore[misc]


def test_none_fields_stay_off_the_wire_and_absent_fields_take_their_defaults():
    assert Sample("s").to_meta() == {"name": "s", "n": 0, "x": 0.0, "ranks": ()}
    assert Sample.from_meta({"name": "s", "unknown": 1}) == Sample("s")
    assert Sample.from_meta({"name": "s", "x": 2}).x == 2  # an int is a float's wire form too


@pytest.mark.parametrize(
    "meta, error",
    [
        ({}, "'sample' needs field 'name'"),
        ({"name": 1}, "'sample' field name=1 is not str"),
        ({"name": "s", "n": "3"}, "'sample' field n='3' is not int"),
        ({"name": "s", "n": True}, "'sample' field n=True is not int"),
        ({"name": "s", "inner": [1]}, "'sample' field inner=[1] is not dict"),
        ({"name": "s", "inner": {}}, "'inner' needs field 'a'"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_naming_op_field_and_value(meta, error):
    with pytest.raises(MessageError, match=re.escape(error)):
        Sample.from_meta(meta)


class FakeRequest:
    def __init__(self, op: str, meta: dict) -> None:
        self.op, self.meta, self.failed = op, meta, None

    def fail(self, message: str) -> None:
        self.failed = message


def test_routes_call_the_handler_with_the_decoded_message_and_refuse_unknown_ops():
    seen = []
    routes = Routes({Sample: lambda request, msg: seen.append((request.op, msg))})
    routes.serve(FakeRequest("sample", {"name": "a"}))
    assert seen == [("sample", Sample("a"))]
    unknown = FakeRequest("nope", {})
    routes.serve(unknown)
    assert unknown.failed == "unknown op 'nope'"
    assert routes.route("nope", {}) is False


def test_two_routes_for_one_op_are_refused():
    with pytest.raises(ValueError, match="two routes for op 'sample'"):
        Routes({Sample: print, type("Other", (Sample,), {"__slots__": ()}): print})


def test_a_field_type_without_a_wire_form_is_refused_at_the_table():
    @dataclass(frozen=True, slots=True)
    class Bad(Message, op="bad"):
        when: set

    with pytest.raises(TypeError, match="has no wire form"):
        Routes({Bad: print})


def test_the_register_reply_nests_the_membership():
    reply = cluster.Registered(1, [["h", 5]], [["h", 9]], cluster.Membership(3, (0, 1), (1,)), joined=True)
    meta = msgpack.unpackb(msgpack.packb(reply.to_meta()), raw=False)
    assert meta["membership"] == {"generation": 3, "workers": [0, 1], "joiners": [1]}
    assert cluster.Registered.from_meta(meta) == reply


def test_a_registration_describes_its_node_before_it_has_a_rank():
    register = cluster.Register("worker", "h", 12, "1.0", "d")
    assert register.describe() == "worker ? (host h, pid 12)"
    with pytest.raises(MessageError, match="'register' field rank='2' is not int or NoneType"):
        cluster.Register.from_meta({**register.to_meta(), "rank": "2"})


def test_a_message_is_made_alike_before_and_after_its_codec_and_stays_frozen():
    @dataclass(frozen=True, slots=True, kw_only=True)
    class Frame(Message, op="frame", omit_defaults=True):
        keys: list
        weight: int = 1
        more: bool = False
        read: list = dataclasses.field(default_factory=list)

    before = Frame(keys=[1])
    assert before.to_meta() == {"keys": [1], "read": []}  # at their defaults: off the wire
    after = Frame(keys=[1])  # made by the codec's __init__ now
    assert after == before and after.read is not before.read
    assert Frame(keys=[2], weight=3, more=True).wire() == (
        "frame",
        {"keys": [2], "weight": 3, "more": True, "read": []},
    )
    with pytest.raises(TypeError):
        Frame(keys=[1], wieght=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Frame()  # type: ignore[call-arg]
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.weight = 2  # type: ignore[misc]
