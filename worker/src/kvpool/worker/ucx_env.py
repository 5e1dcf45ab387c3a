"""Which network device NIXL's UCX backend may use: the one that holds the pod's IP.

Why this module exists: LMCache's P2P and PD backends move KV through NIXL over UCX, and UCX
by default opens every network device of the host. In a pod that is the pod network (fine),
but on one machine (``kvpool-operator up``, the tests, the demo) it listens on the external
interface although every other socket binds 127.0.0.1. The operator renders ``POD_IP`` (the
downward API; ``kvpool-operator up`` maps it to 127.0.0.1), so the worker restricts UCX to the
device carrying that address: ``eth0`` (or whatever the CNI named it) in a cluster, ``lo``
locally. An explicit ``UCX_NET_DEVICES`` in the pod spec always wins.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Mapping, MutableMapping

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of a device


def device_for_ip(ip: str, addresses: Mapping[str, str]) -> str | None:
    """The device whose address is ``ip`` (``lo`` for any loopback address); pure."""
    try:
        wanted = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if wanted.is_loopback:
        return next((d for d, a in addresses.items() if ipaddress.ip_address(a).is_loopback), "lo")
    return next((d for d, a in addresses.items() if ipaddress.ip_address(a) == wanted), None)


def local_ipv4_addresses() -> dict[str, str]:
    """IPv4 address of every device of this host (Linux), by device name."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                request = struct.pack("256s", name[:15].encode())
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
                out[name] = socket.inet_ntoa(packed[20:24])
    return out


def restrict_ucx(env: MutableMapping[str, str]) -> str | None:
    """Set ``UCX_NET_DEVICES`` to the device holding ``POD_IP`` unless already set; returns
    the value in effect (None when nothing could be derived: UCX then picks)."""
    if env.get("UCX_NET_DEVICES"):
        return env["UCX_NET_DEVICES"]
    ip = env.get("POD_IP")
    if not ip:
        return None
    try:
        device = device_for_ip(ip, local_ipv4_addresses())
    except OSError as exc:
        logger.warning("cannot list network devices to restrict UCX (%s): UCX picks", exc)
        return None
    if device is None:
        logger.warning("no network device holds POD_IP %s: UCX picks its devices", ip)
        return None
    env["UCX_NET_DEVICES"] = device
    logger.info("NIXL/UCX restricted to device %s (holds POD_IP %s)", device, ip)
    return device
