"""Every message of our protocol module is byte-compatible with LMCache 0.5.6's ``message.py``.

Why: stock LMCache workers must talk to our controller unchanged, and the controller must not
import LMCache. This test (which does import LMCache) builds a sample of every struct from its
field types, encodes it on one side and decodes it on the other, in both directions.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import pytest
from lmcache.v1.cache_controller import message as lm

from kvpool.protocol import lmcache_codec as codec
from kvpool.protocol import lmcache_wire as p

OURS = typing.get_args(p.Msg)
THEIRS = {cls.__name__: cls for cls in typing.get_args(lm.Msg)}


def _sample(info: msgspec.inspect.Type, depth: int = 0) -> Any:
    t = msgspec.inspect
    match info:
        case t.StrType():
            return "s"
        case t.BoolType():
            return True
        case t.IntType():
            return 7
        case t.FloatType():
            return 1.5
        case t.NoneType():
            return None
        case t.UnionType():
            non_none = [x for x in info.types if not isinstance(x, t.NoneType)]
            return _sample(non_none[0], depth)
        case t.ListType():
            return [_sample(info.item_type, depth + 1)]
        case t.TupleType():
            return [_sample(x, depth + 1) for x in info.item_types]
        case t.DictType():
            return {_sample(info.key_type): _sample(info.value_type, depth + 1)}
        case t.EnumType():
            return next(iter(info.cls)).value
        case t.StructType():
            out = {f.encode_name: _sample(f.type, depth + 1) for f in info.fields}
            if info.tag_field is not None:
                out[info.tag_field] = info.tag
            return out
        case t.AnyType():
            return {"k": 1}
    raise AssertionError(f"no sample for {info}")


def _wire_sample(cls: type) -> dict[str, Any]:
    sample = _sample(msgspec.inspect.type_info(cls))
    assert isinstance(sample, dict)
    return sample


def test_every_lmcache_message_has_our_twin() -> None:
    assert {c.__name__ for c in OURS} == set(THEIRS)


@pytest.mark.parametrize("cls", OURS, ids=lambda c: c.__name__)
def test_ours_decodes_as_lmcache_and_back(cls: type) -> None:
    wire = _wire_sample(cls)
    ours = msgspec.convert(wire, type=cls)
    repr(ours)
    data = codec.encode(ours)
    theirs = msgspec.msgpack.decode(data, type=lm.Msg)
    assert type(theirs).__name__ == cls.__name__
    assert msgspec.to_builtins(theirs) == msgspec.to_builtins(ours)
    back = codec.decode(msgspec.msgpack.encode(theirs))
    assert back == ours


def test_heartbeat_full_sync_command_round_trips() -> None:
    from lmcache.v1.cache_controller.commands import FullSyncCommand

    theirs = lm.HeartbeatRetMsg(commands=[FullSyncCommand(reason="controller_restart")])
    ours = codec.decode(msgspec.msgpack.encode(theirs))
    assert ours == p.HeartbeatRetMsg([p.FullSyncCommand(reason="controller_restart")])
    again = msgspec.msgpack.decode(codec.encode(ours), type=lm.Msg)
    assert isinstance(again.commands[0], FullSyncCommand)


def test_json_frames_decode_like_lmcache() -> None:
    frame = msgspec.json.encode(lm.DeRegisterMsg(instance_id="i", worker_id=0, ip="h", port=1))
    assert codec.decode(frame) == p.DeRegisterMsg("i", 0, "h", 1)


@pytest.mark.parametrize(
    ("frame", "kind"),
    [
        (b"", "empty"),
        (msgspec.msgpack.encode({"type": "NoSuchMsg"}), "unknown_tag"),
        (msgspec.msgpack.encode({"no_type": 1}), "unknown_tag"),
        (msgspec.msgpack.encode(lm.RegisterMsg("i", 0, "h", 1, None))[:-3], "truncated"),
        (b"\xc1\xc1", "malformed"),
        (msgspec.msgpack.encode({"type": "RegisterMsg", "instance_id": 5}), "invalid"),
        (b"{not json", "malformed"),
    ],
)
def test_bad_frames_raise_a_classified_protocol_error(frame: bytes, kind: str) -> None:
    with pytest.raises(codec.ProtocolError) as err:
        codec.decode(frame)
    assert err.value.kind == kind


def test_parse_router_frames() -> None:
    assert codec.parse_router_frames([b"id", b"", b"x"]) == (b"id", b"x")
    for bad in ([b"id", b"x"], [b"id", b"nonempty", b"x"], []):
        with pytest.raises(codec.ProtocolError):
            codec.parse_router_frames(bad)
