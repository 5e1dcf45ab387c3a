"""``kvpool-operator demo``: bring a domain up and replay a short agent workload through it.

Why this module exists: the first thing a user runs (``make demo``) must show the pool doing
its job with numbers that come from the running processes, not from a script: sessions that
share a long system prompt, multi-turn conversations whose next turn hits the previous
answer's KV, one session moved to the other P2P worker (its KV pulled from the peer), PD
requests through the gateway's proxy, and ``/memory/evict`` / ``/memory/prefetch`` between
turns. Every number printed is read from a response, a response header or the controller's
index: instance and routing reason from the gateway's headers, hit tokens from
``usage.prompt_tokens_details.cached_tokens``, the tier from the controller's
``/v1/prefix_lookup`` just before the turn, TTFT measured here over HTTP, against the same
turn sent cold (its first message made unique, so no KV exists anywhere). A missing piece
(no gateway, no memory API, no PD route) stops the demo with a message naming it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvpool.protocol import http_api

INSTANCE_HEADER = http_api.INSTANCE
REASON_HEADER = http_api.ROUTE_REASON
SESSION_HEADER = http_api.SESSION
PD_HEADER = http_api.PD  # the gateway's PD proxy for the named pair


class DemoError(RuntimeError):
    """A piece the demo needs is missing or misbehaves; the message names it."""


# --------------------------------------------------------------------------- HTTP (stdlib)
def post(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """POST JSON, return JSON; any non-200 is a DemoError naming the URL and the answer."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            out: dict[str, Any] = json.loads(resp.read())
            return out
    except urllib.error.HTTPError as exc:
        raise DemoError(f"POST {url} answered {exc.code}: {exc.read()[:300]!r}") from None
    except OSError as exc:
        raise DemoError(f"POST {url} failed: {exc}") from None


@dataclass
class Reply:
    """One streamed chat completion as the client saw it."""

    text: str
    usage: dict[str, Any]
    ttft_s: float
    headers: dict[str, str]

    @property
    def cached(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", 0))


def _events(resp: Any) -> Iterator[dict[str, Any]]:
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


def chat(
    base: str,
    messages: list[dict[str, str]],
    headers: dict[str, str],
    max_tokens: int = 16,
    model: str | None = None,
) -> Reply:
    """A streamed, greedy chat completion; TTFT = first content byte, measured here."""
    body: dict[str, Any] = {"model": model} if model else {}
    body |= {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json", **headers},
        method="POST",
    )
    parts: list[str] = []
    usage: dict[str, Any] = {}
    ttft: float | None = None
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            got = {k.lower(): v for k, v in resp.headers.items()}
            for event in _events(resp):
                for choice in event.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        parts.append(piece)
                usage = event.get("usage") or usage
    except urllib.error.HTTPError as exc:
        raise DemoError(f"chat at {base} answered {exc.code}: {exc.read()[:300]!r}") from None
    except OSError as exc:
        raise DemoError(f"chat at {base} failed: {exc}") from None
    if ttft is None or not usage:
        raise DemoError(f"chat at {base}: the stream carried no content or no usage")
    return Reply("".join(parts), usage, ttft, got)


# --------------------------------------------------------------------------- the workload
def system_prompt(sentences: int) -> str:
    """A long, deterministic system prompt shared by every session."""
    rules = [
        "answer in short sentences",
        "cite the ledger row you used",
        "never round the totals",
        "flag a missing receipt",
        "keep the currency of the source",
    ]
    return " ".join(
        f"Rule {i}: when the user asks about account {i % 17}, {rules[i % len(rules)]}."
        for i in range(sentences)
    )


@dataclass
class Turn:
    """One request of the workload and everything measured about it."""

    label: str
    session: str
    kind: str  # "chat", "moved", "pd"
    instance: str
    reason: str
    prompt_tokens: int
    hit_tokens: int
    tier: str
    ttft_s: float
    cold_ttft_s: float | None = None
    text: str = ""


@dataclass
class Domain:
    """Where the pieces of the running domain listen (from ``up``'s state file)."""

    gateway: str
    controller: str
    p2p: dict[str, str]  # instance name -> URL
    pd_pairs: list[str]
    instance_ids: dict[str, str]  # instance name -> lmcache_instance_id
    chunk_size: int


@dataclass
class Demo:
    """Replays the workload against ``domain``; ``say`` gets the progress lines."""

    domain: Domain
    say: Callable[[str], None]
    turns: list[Turn] = field(default_factory=list)
    sessions: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    system: str = field(default_factory=lambda: system_prompt(90))

    def tokens(self, messages: list[dict[str, str]]) -> list[int]:
        any_worker = next(iter(self.domain.p2p.values()))
        out = post(f"{any_worker}/tokenize", {"messages": messages})
        return [int(t) for t in out["tokens"]]

    def holders(self, messages: list[dict[str, str]]) -> dict[str, dict[str, Any]]:
        """Controller's view before the turn: instance name -> {hit_chunks, per_location}."""
        out = post(f"{self.domain.controller}/v1/prefix_lookup", {"tokens": self.tokens(messages)})
        by_id = {v: k for k, v in self.domain.instance_ids.items()}
        return {by_id.get(i, i): dict(v) for i, v in out.get("instances", {}).items()}

    def tier(self, served: str, hit: int, held: dict[str, dict[str, Any]]) -> str:
        """Where the hit came from: the serving instance's own tiers, else its peers'."""
        if hit == 0:
            return "-"
        own = held.get(served, {})
        own_tokens = int(own.get("hit_chunks", 0)) * self.domain.chunk_size
        tiers = "+".join(sorted(own.get("per_location", {}))) or "local"
        peers = [n for n, v in held.items() if n != served and int(v.get("hit_chunks", 0)) > 0]
        if hit > own_tokens and peers:
            return f"P2P from {peers[0]}" + (f" + {tiers}" if own_tokens else "")
        return tiers

    def cold(self, base: str, messages: list[dict[str, str]], headers: dict[str, str]) -> float:
        """The same turn with its first message made unique: no KV for it exists anywhere."""
        nonce = f"[cold {len(self.turns)} {time.time_ns()}] "
        unique = [{**messages[0], "content": nonce + messages[0]["content"]}, *messages[1:]]
        return chat(base, unique, headers).ttft_s

    def turn(self, session: str, user: str, label: str, *, move_to: str | None = None) -> Turn:
        """One user turn of ``session`` through the gateway (``move_to``: pinned there)."""
        history = self.sessions.setdefault(session, [{"role": "system", "content": self.system}])
        messages = [*history, {"role": "user", "content": user}]
        held = self.holders(messages)
        headers = {SESSION_HEADER: session}
        if move_to:
            headers[INSTANCE_HEADER] = move_to
        reply = chat(self.domain.gateway, messages, headers)
        if INSTANCE_HEADER not in reply.headers:
            raise DemoError(
                f"the gateway's reply has no {INSTANCE_HEADER} header: cannot tell which "
                "instance served the turn"
            )
        instance = reply.headers[INSTANCE_HEADER]
        reason = reply.headers.get(REASON_HEADER, "(gateway gave no reason)")
        if move_to and instance != move_to:
            raise DemoError(f"{label}: pinned to {move_to}, the gateway sent it to {instance}")
        pin = {INSTANCE_HEADER: instance}  # cold: the same instance, through the gateway too
        cold = (
            self.cold(self.domain.gateway, messages, pin) if instance in self.domain.p2p else None
        )
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply.text}]
        t = Turn(
            label,
            session,
            "moved" if move_to else "chat",
            instance,
            reason,
            reply.prompt_tokens,
            reply.cached,
            self.tier(instance, reply.cached, held),
            reply.ttft_s,
            cold,
            reply.text,
        )
        self.turns.append(t)
        self.say(
            f"  {label:<24} {instance:<11} ({reason}) hit {t.hit_tokens:>5}/{t.prompt_tokens:<5}"
            f" TTFT {t.ttft_s * 1000:5.0f} ms, cold {_ms(t.cold_ttft_s)}"
        )
        return t

    def memory(self, verb: str, session: str) -> dict[str, Any]:
        """``/memory/<verb>`` through the gateway, for one session's prefix."""
        out = post(f"{self.domain.gateway}/memory/{verb}", {"session_id": session})
        if not out.get("ok"):
            raise DemoError(f"/memory/{verb} {session}: {json.dumps(out)[:400]}")
        done = {
            name: report.get("result")
            for name, report in out.get("instances", {}).items()
            if any(v for v in (report.get("result") or {}).values() if isinstance(v, int))
        }
        self.say(f"  /memory/{verb} {session}: {json.dumps(done, sort_keys=True)}")
        return out

    def pd(self, label: str, user: str, pair: str) -> Turn:
        """A request through the gateway's PD proxy for ``pair``."""
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": user}]
        reply = chat(self.domain.gateway, messages, {PD_HEADER: pair, SESSION_HEADER: label})
        instance = reply.headers.get(INSTANCE_HEADER, "")
        if not instance.startswith(pair):
            raise DemoError(
                f"a request for PD pair {pair} was served by {instance or 'an unnamed instance'}:"
                " the gateway does not route PD requests to the pair"
            )
        t = Turn(
            label, label, "pd", instance, reply.headers.get(REASON_HEADER, "PD pair"),
            reply.prompt_tokens, reply.cached, "PD transfer" if reply.cached else "-",
            reply.ttft_s, None, reply.text,
        )  # fmt: skip
        self.turns.append(t)
        self.say(
            f"  {label:<24} {instance} transferred {t.hit_tokens}/{t.prompt_tokens} tokens, "
            f"TTFT {t.ttft_s * 1000:.0f} ms"
        )
        return t

    def run(self) -> None:
        """The agent workload (see the module docstring)."""
        names = sorted(self.domain.p2p)
        if len(names) < 2:
            raise DemoError(f"the demo needs two P2P instances, the domain has {names}")
        for name, url in sorted(self.domain.p2p.items()):  # first-call costs stay out of TTFTs
            chat(url, [{"role": "user", "content": "warm-up"}], {}, max_tokens=2)
            self.say(f"  warmed up {name}")
        self.say("turns (sessions share the system prompt; later turns carry the history):")
        self.turn("alice", "What does rule 3 say about account 3?", "alice turn 1")
        self.turn("bob", "Summarise the rules for account 5.", "bob turn 1")
        self.turn("alice", "And what about account 4?", "alice turn 2")
        self.turn("bob", "Which rule mentions receipts?", "bob turn 2")
        self.memory("evict", "bob")
        self.turn("bob", "Repeat the receipt rule.", "bob turn 3 (evicted)")
        self.memory("prefetch", "bob")
        self.turn("bob", "Now the currency rule.", "bob turn 4 (prefetched)")
        served = self.turns[2].instance
        other = next(n for n in names if n != served)
        self.turn("alice", "One more: account 6?", "alice turn 3 (moved)", move_to=other)
        for i, pair in enumerate(self.domain.pd_pairs * 2):
            self.pd(f"pd request {i + 1}", f"Audit account {i + 7} under every rule.", pair)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


# --------------------------------------------------------------------------- the report
def summary(turns: list[Turn]) -> dict[str, Any]:
    """The demo's last line: every number derived from the turns above."""
    chats = [t for t in turns if t.kind != "pd"]
    hits = [t for t in chats if t.hit_tokens > 0 and t.cold_ttft_s]
    prompt = sum(t.prompt_tokens for t in chats)
    ratio = (
        (sum(t.ttft_s for t in hits) / len(hits))
        / (sum(t.cold_ttft_s or 0 for t in hits) / len(hits))
        if hits
        else None
    )
    return {
        "turns": len(chats),
        "hit_ratio": round(sum(t.hit_tokens for t in chats) / prompt, 4) if prompt else 0.0,
        "p2p_hit_tokens": sum(t.hit_tokens for t in chats if t.tier.startswith("P2P")),
        "pd_requests": sum(1 for t in turns if t.kind == "pd"),
        "pd_transferred_tokens": sum(t.hit_tokens for t in turns if t.kind == "pd"),
        "ttft_hit_over_cold": round(ratio, 3) if ratio is not None else None,
    }


def table(turns: list[Turn]) -> str:
    """Markdown: per turn the instance and why, hit tokens and tier, TTFT against cold."""
    rows = [
        "| turn | instance | why | hit / prompt tokens | tier | TTFT | cold TTFT | hit/cold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in turns:
        ratio = f"{t.ttft_s / t.cold_ttft_s:.2f}" if t.cold_ttft_s else "-"
        rows.append(
            f"| {t.label} | {t.instance} | {t.reason} | {t.hit_tokens} / {t.prompt_tokens} | "
            f"{t.tier} | {_ms(t.ttft_s)} | {_ms(t.cold_ttft_s)} | {ratio} |"
        )
    return "\n".join(rows)


def plot(turns: list[Turn], path: Path) -> Path:
    """A PNG: TTFT per turn, hit against cold, with the hit share of each prompt."""
    try:
        import matplotlib  # noqa: PLC0415 (only the demo draws)
    except ImportError:
        raise DemoError(
            "the plot needs matplotlib: pip install 'kvpool-operator[demo]' (make install does)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    chats = [t for t in turns if t.cold_ttft_s]
    xs = range(len(chats))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.bar([x - 0.2 for x in xs], [t.cold_ttft_s or 0 for t in chats], 0.4, label="cold")
    ax.bar([x + 0.2 for x in xs], [t.ttft_s for t in chats], 0.4, label="through kvpool")
    for x, t in zip(xs, chats, strict=True):
        share = t.hit_tokens / t.prompt_tokens if t.prompt_tokens else 0
        ax.annotate(f"{share:.0%} hit", (x + 0.2, t.ttft_s), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [t.label for t in chats], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TTFT (s)")
    ax.set_title("kvpool demo: time to first token per turn, cold vs. with the pool")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(turns: list[Turn], png: Path, out: TextIO) -> dict[str, Any]:
    """Print the table, write the plot, print the JSON line last."""
    print("", file=out)
    print(table(turns), file=out)
    print(f"\nplot: {plot(turns, png)}", file=out)
    result = summary(turns)
    print(json.dumps(result, sort_keys=True), file=out, flush=True)
    return result


# --------------------------------------------------------------------------- the command
def domain_of(objects: list[dict[str, Any]], state: dict[str, Any]) -> Domain:
    """Where everything listens, from the render (names, ids) and ``up``'s state (URLs)."""
    import yaml  # noqa: PLC0415

    from kvpool.operator.local.plan import workloads  # noqa: PLC0415

    loads = workloads(objects)
    urls: dict[str, str] = state["endpoints"]
    by_component = {w.component: n for n, w in loads.items() if w.component != "worker"}
    for needed in ("gateway", "controller"):
        if needed not in by_component:
            raise DemoError(f"the render has no {needed}")
    (gateway_yaml,) = loads[by_component["gateway"]].files.values()
    routing = yaml.safe_load(gateway_yaml)
    ids: dict[str, str] = {}
    chunk = 0
    for name, w in loads.items():
        if w.component == "worker":
            (text,) = w.files.values()
            cfg = yaml.safe_load(text)
            ids[name] = str(cfg["lmcache_instance_id"])
            chunk = int(cfg["chunk_size"])
    p2p = {i["name"]: urls[i["name"]] for g in routing.get("p2pGroups", []) for i in g["instances"]}
    return Domain(
        gateway=urls[by_component["gateway"]],
        controller=urls[by_component["controller"]],
        p2p=p2p,
        pd_pairs=[p["name"] for p in routing.get("pdPairs", [])],
        instance_ids=ids,
        chunk_size=chunk,
    )


def run_demo(files: list[str], state_dir: Path, png: Path, out: TextIO) -> int:
    """``up`` the domain, replay the workload, report, stop everything (also on Ctrl-C)."""
    from kvpool.operator.local.up import UpProcess, render_files  # noqa: PLC0415

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    t0 = time.monotonic()
    rendered = render_files(files)
    say(f"demo: starting the domain of {', '.join(files)} (kvpool-operator up)")
    with UpProcess(files, state_dir) as stack:
        state = stack.start(echo=out)
        say(f"demo: domain up in {time.monotonic() - t0:.0f}s; replaying the agent workload")
        demo = Demo(domain_of(rendered.objects, state), say)
        demo.run()
        say("demo: stopping every process")
    report(demo.turns, png, out)
    return 0
