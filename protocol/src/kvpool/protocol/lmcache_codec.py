"""Frames of LMCache 0.5.6's controller protocol to messages and back, every fault classified.

Why this module exists: :mod:`kvpool.protocol.lmcache_wire` declares the messages as LMCache
does; this is what kvpool adds on the wire. ``decode`` is pure and turns every kind of bad
input (empty, truncated, not msgpack or JSON, an unknown ``type``, a wrong field) into a
:class:`ProtocolError` whose ``kind`` the controller counts, so a bad frame is a metric and
never a crash; it also reads the JSON that Mooncake's master posts. ``parse_router_frames``
checks a ROUTER envelope. Both sides use it: the controller (server) and the simulated
engine (worker side).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpool.protocol.lmcache_wire import Msg

__all__ = ["ProtocolError", "decode", "encode", "parse_router_frames"]

_MSGPACK_DECODER = msgspec.msgpack.Decoder(Msg)
_JSON_DECODER = msgspec.json.Decoder(Msg)
_ENCODER = msgspec.msgpack.Encoder()

# A message is always a msgpack map (first byte 0x80-0x8f, 0xde or 0xdf); 0x7b ("{") would be a
# bare positive integer in msgpack, never a message. So a leading "{" unambiguously means JSON
# (Mooncake's master posts JSON to LMCache's controller).
_JSON_START = ord("{")


class ProtocolError(ValueError):
    """A frame that is not a valid message; ``kind`` names the class of fault for metrics."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def decode(frame: bytes) -> Any:
    """Decode one frame into a message struct, or raise :class:`ProtocolError`.

    Kinds: ``empty``, ``truncated``, ``malformed`` (not msgpack/JSON), ``unknown_tag`` (a
    ``type`` this protocol does not know), ``invalid`` (a known message with a wrong field).
    """
    if not frame:
        raise ProtocolError("empty", "empty frame")
    try:
        if frame[0] == _JSON_START:
            return _JSON_DECODER.decode(frame)
        return _MSGPACK_DECODER.decode(frame)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if "`$.type`" in text or "missing required field `type`" in text:
            raise ProtocolError("unknown_tag", text) from exc
        raise ProtocolError("invalid", text) from exc
    except msgspec.DecodeError as exc:
        text = str(exc)
        kind = "truncated" if "truncated" in text else "malformed"
        raise ProtocolError(kind, text) from exc


def encode(msg: msgspec.Struct) -> bytes:
    """Encode a message struct to msgpack bytes."""
    return _ENCODER.encode(msg)


def parse_router_frames(frames: list[bytes]) -> tuple[bytes, bytes]:
    """Split a ROUTER multipart ``[identity, b"", payload]`` into ``(identity, payload)``.

    Raises :class:`ProtocolError` (kind ``frames``) when the envelope is not that shape; the
    identity is returned even then when present, so the caller can still answer with an error.
    """
    if len(frames) != 3 or frames[1] != b"":
        raise ProtocolError("frames", f"expected [identity, b'', payload], got {len(frames)}")
    return frames[0], frames[2]
