"""The chaos suite's own network namespace, and the network cut of one worker.

Why this module exists: cutting a worker off the network means dropping its packets, which
takes a packet filter (nftables) and the right to change it. Doing that on a shared machine's
loopback would touch every other process's traffic, and a suite killed half-way would leave
its rules behind. So ``make chaos`` runs itself in a new network namespace (``unshare --net``,
inside a user namespace when it is not root): its own loopback and its own nftables, gone with
the last process of the suite however it ends. Every process ``kvpool-operator up`` starts is
in it; nothing outside can reach them nor be reached by them, which also suits "bind
127.0.0.1". A veth pair with a private address is added because Mooncake's transfer engine
refuses to start on a host whose only interface is the loopback ("not valid LAN address
found").

The cut (:class:`Cut`) is a partition, not a closed port: one nftables table drops every TCP
packet to or from the ports the worker's processes listen on, and both directions of each of
their connections at that moment, by its addresses and ports (the gateway's keep-alive
connections and probes, the controller's heartbeat and control sockets, P2P peers, NIXL,
Mooncake). A closed port answers a reset at
once; a partition answers nothing, which is the harder case for every client (connect and
read timeouts, TCP retransmission backoff after the cut heals). A connection the worker opens
during the cut from a new port is not cut. Healing deletes the table.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass, field

ENV_MARK = "KVPOOL_CHAOS_NETNS"  # set in the namespace: do not enter another one
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_VETH = ("kvchaos0", "kvchaos1", "10.213.0.1/24")


class NetnsError(RuntimeError):
    """The namespace or the packet filter cannot be had here (the message says why)."""


def in_namespace() -> bool:
    return os.environ.get(ENV_MARK) == "1"


def unshare_argv() -> list[str]:
    """The ``unshare`` prefix that runs a command in a new network namespace (and a user
    namespace unless root), checked by running ``true`` in one; NetnsError naming why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise NetnsError("unshare (util-linux) is not installed")
    argv = [unshare, "--net"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    probe = subprocess.run([*argv, "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} refused: {probe.stderr.strip()}")
    return argv


def reenter(module: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Run ``python -m module argv`` again in a new network namespace, in place of this process
    (no return); 2, with the reason on stderr, when none can be had here."""
    try:
        prefix = unshare_argv()
    except NetnsError as exc:
        print(f"{module}: no network namespace ({exc}): run with --no-netns", file=sys.stderr)
        return 2
    env = {**os.environ, **(env or {}), ENV_MARK: "1"}
    os.execvpe(prefix[0], [*prefix, sys.executable, "-m", module, *argv], env)


def setup(with_lan: bool) -> None:
    """In a fresh namespace: the loopback up; with ``with_lan`` the veth pair (needs ``ip``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))
    if not with_lan:
        return
    ip = shutil.which("ip")
    if ip is None:
        raise NetnsError("Mooncake needs a non-loopback address: install iproute2 (ip)")
    a, b, addr = _VETH
    for cmd in (
        ["link", "add", a, "type", "veth", "peer", "name", b],
        ["addr", "add", addr, "dev", a],
        ["link", "set", a, "up"],
        ["link", "set", b, "up"],
    ):
        subprocess.run([ip, *cmd], check=True, capture_output=True)


def nft_available() -> str | None:
    """None when nftables can be changed here, else why not."""
    nft = shutil.which("nft")
    if nft is None:
        return "nft (Debian nftables) is not installed"
    probe = subprocess.run([nft, "list", "tables"], capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else f"nft refused: {probe.stderr.strip()}"


Flow = tuple[str, int, str, int]  # (local address, port, remote address, port)
_LISTEN = "0A"


def _ipv4(hex_addr: str) -> str | None:
    """/proc/net/tcp{,6}'s address as dotted IPv4 (None for a real IPv6 address)."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 16:  # tcp6: only IPv4-mapped addresses (::ffff:a.b.c.d) carry IPv4 packets
        words = [raw[i : i + 4] for i in range(0, 16, 4)]
        if words[:2] != [b"\0" * 4] * 2 or words[2] != b"\0\0\xff\xff":
            return None
        raw = words[3]
    return socket.inet_ntoa(raw[::-1])  # each 32-bit word in host (little-endian) order


def _sockets_by_inode() -> dict[int, tuple[str, Flow]]:
    """Socket inode -> (state, flow) of every IPv4 TCP socket of this namespace."""
    out: dict[int, tuple[str, Flow]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table, encoding="ascii") as fp:
            next(fp, None)  # the header
            for line in fp:
                cols = line.split()
                (la, lp), (ra, rp) = (c.split(":") for c in cols[1:3])
                local, remote = _ipv4(la), _ipv4(ra)
                if local is not None and remote is not None:
                    flow = (local, int(lp, 16), remote, int(rp, 16))
                    out[int(cols[9])] = (cols[3], flow)
    return out


def group_sockets(pgid: int) -> tuple[set[int], set[Flow]]:
    """The TCP ports every process of group ``pgid`` listens on, and its connections' flows."""
    by_inode = _sockets_by_inode()
    listening: set[int] = set()
    flows: set[Flow] = set()
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getpgid(pid) != pgid:
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                found = by_inode.get(int(link[8:-1])) if link.startswith("socket:[") else None
                if found is None:
                    continue
                state, flow = found
                if state == _LISTEN:
                    listening.add(flow[1])
                else:
                    flows.add(flow)
    return listening, flows


@dataclass
class Cut:
    """One worker cut off: ``cut()`` installs the table, ``heal()`` removes it (idempotent)."""

    name: str
    pgid: int
    ports: set[int] = field(default_factory=set)
    flows: set[Flow] = field(default_factory=set)
    active: bool = False

    @property
    def table(self) -> str:
        return "kvchaos_" + "".join(c if c.isalnum() else "_" for c in self.name)

    def rules(self) -> str:
        """Its listening ports both ways, and each connection by its four values both ways (a
        port number alone may be another process's ephemeral port towards another peer)."""
        lines = [f"tcp dport {p} drop\ntcp sport {p} drop" for p in sorted(self.ports)]
        for la, lp, ra, rp in sorted(self.flows):
            if lp in self.ports:
                continue  # an accepted connection: its listening port's rules cover it
            for a, b, c, d in ((la, lp, ra, rp), (ra, rp, la, lp)):
                lines.append(f"ip saddr {a} tcp sport {b} ip daddr {c} tcp dport {d} drop")
        body = "\n".join(lines)
        return (
            f"table inet {self.table} {{\n chain cut {{\n"
            f"  type filter hook output priority 0; policy accept;\n{body}\n }}\n}}\n"
        )

    def cut(self) -> set[int]:
        self.ports, self.flows = group_sockets(self.pgid)
        if not self.ports and not self.flows:
            raise NetnsError(f"{self.name}: process group {self.pgid} has no TCP socket")
        rules = self.rules()
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True, capture_output=True)
        self.active = True
        return self.ports | {lp for _, lp, _, _ in self.flows}

    def heal(self) -> None:
        if self.active:
            subprocess.run(["nft", "delete", "table", "inet", self.table], check=False)
            self.active = False
