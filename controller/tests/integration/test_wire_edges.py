"""The controller's sockets under bad input, the delta stream to a replica, and SIGTERM.

Real sockets against the real controller process: garbage on the PULL and ROUTER sockets is
counted and answered, never fatal; a replica following the PUB stream (with a snapshot from the
snapshot socket) answers the same prefix lookups as the controller; SIGTERM exits 0.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq
from conftest import free_port, wait_until
from lmcache.v1.cache_controller import message as lm

from kvpool.protocol import deltas

REG = lm.RegisterMsg(instance_id="i", worker_id=0, ip="127.0.0.1", port=1, peer_init_url="p")


def _ops(keys: list[int], start: int, op: lm.OpType = lm.OpType.ADMIT) -> list[lm.KVOpEvent]:
    return [lm.KVOpEvent(op_type=op, key=k, seq_num=start + i) for i, k in enumerate(keys)]


def test_bad_frames_are_counted_and_answered_never_fatal(controllers: Any) -> None:
    ctl = controllers()
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{ctl.ports['pull']}")
    good = msgspec.msgpack.encode(REG)
    push.send_multipart([b"\xc1garbage", good[:-4], msgspec.msgpack.encode({"type": "Nope"}), b""])
    push.send(
        msgspec.msgpack.encode(
            lm.BatchedKVOperationMsg(
                instance_id="ghost", worker_id=0, location="L", operations=_ops([1], 0)
            )
        )
    )
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{ctl.ports['reply']}")
    dealer.send_multipart([b"", b"\x93\x01"])  # truncated msgpack
    assert isinstance(msgspec.msgpack.decode(dealer.recv_multipart()[-1], type=lm.Msg), lm.ErrorMsg)
    dealer.send_multipart([b"no-delimiter"])
    assert isinstance(msgspec.msgpack.decode(dealer.recv_multipart()[-1], type=lm.Msg), lm.ErrorMsg)
    # ...and the controller still works
    dealer.send_multipart([b"", good])
    assert isinstance(
        msgspec.msgpack.decode(dealer.recv_multipart()[-1], type=lm.Msg), lm.RegisterRetMsg
    )
    push.send(
        msgspec.msgpack.encode(
            lm.BatchedKVOperationMsg(
                instance_id="i", worker_id=0, location="L", operations=_ops([1, 2], 0)
            )
        )
    )
    wait_until(lambda: ctl.hits([1, 2]) == {"i": 2})
    for kind in ("malformed", "truncated", "unknown_tag", "empty", "unknown_worker", "frames"):
        assert ctl.metric(f'kvpool_controller_bad_input_total{{kind="{kind}"}}') >= 1, kind
    ctx.destroy(linger=0)


def test_replica_follows_the_delta_stream(controllers: Any) -> None:
    pub, snap = free_port(), free_port()
    ctl = controllers("--pub-port", str(pub), "--snapshot-port", str(snap))
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{ctl.ports['pull']}")
    push.send(msgspec.msgpack.encode(REG))
    push.send(
        msgspec.msgpack.encode(
            lm.BatchedKVOperationMsg(
                instance_id="i", worker_id=0, location="L", operations=_ops([1, 2, 3], 0)
            )
        )
    )
    wait_until(lambda: ctl.hits([1, 2, 3]) == {"i": 3})

    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, deltas.TOPIC)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, 5000)
    req.connect(f"tcp://127.0.0.1:{snap}")
    replica = deltas.IndexReplica()

    def pump() -> None:
        while sub.poll(50):
            _, frame = sub.recv_multipart()
            replica.apply_batch(deltas.decode_batch(frame))
        if replica.needs_snapshot:
            req.send_multipart([b"", deltas.SNAPSHOT_REQUEST])
            replica.load_snapshot(deltas.decode_snapshot(req.recv_multipart()[-1]))

    pump()  # first contact: a snapshot
    assert replica.prefix_hits([1, 2, 3])["i"].hit_chunks == 3
    seq = 3
    for keys, op in (([4, 5], lm.OpType.ADMIT), ([2], lm.OpType.EVICT)):
        push.send(
            msgspec.msgpack.encode(
                lm.BatchedKVOperationMsg(
                    instance_id="i", worker_id=0, location="L", operations=_ops(keys, seq, op)
                )
            )
        )
        seq += len(keys)
    wait_until(lambda: ctl.hits([1, 2, 3, 4, 5]) == {"i": 1})

    def converged() -> bool:
        pump()
        hits = replica.prefix_hits([1, 2, 3, 4, 5])
        return {k: v.hit_chunks for k, v in hits.items()} == {"i": 1} and replica.prefix_hits(
            [3, 4, 5]
        )["i"].hit_chunks == 3

    wait_until(converged, what="replica converged")
    assert replica.workers[("i", 0)].peer_init_url == "p"
    ctx.destroy(linger=0)


def test_sigterm_exits_cleanly(controllers: Any) -> None:
    ctl = controllers()
    assert ctl.terminate() == 0
    assert "controller stopped" in ctl.log.read_text()
