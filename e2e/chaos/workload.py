"""The load the chaos suite keeps on the domains while it breaks them: Mooncake-format traces,
replayed open loop by kvpool's own client with retries.

Why this module exists: a fault is only interesting under load, and its cost is only
measurable per request. Each stream is a Mooncake-format trace (``timestamp``,
``input_length``, ``output_length``, ``hash_ids``) that the suite writes itself (CI has no
shared trace): tenants whose requests share a system prompt of a few blocks, each request that
prefix plus one of a fixed set of questions. So prompts repeat (hits, routing by KV, P2P
pulls) and every distinct prompt has a fault-free answer to compare with: the first rows of a
stream visit every prompt once before any fault. Any Mooncake-format file can replace the
simulated fleet's trace (``--sim-trace``, e.g. ../shared/traces/); its prompts that were only
answered during faults are checked by a fault-free request at the end.

The trace goes through the replay's own path (``replay_plan.load_trace``, the
``BlockPromptBuilder``, ``make_jobs``: greedy completions with ``ignore_eos``, streamed with
usage) to ``loadgen.Replay`` with ``retries`` and ``keep_text``; a prompt's identity is its
domain, hash ids and lengths.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.gateway.loadgen import Endpoint, Job, Outcome, Replay
from kvpool.gateway.replay_plan import Loaded, load_trace, make_jobs, prompt_builder
from kvpool.gateway.traces import TraceRequest, Window
from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR, load_tokenizer

#: A prompt: (domain, hash ids, input length, output length).
PromptKey = tuple[str, tuple[int, ...], int, int]
TIMEOUT_S = 30.0  # the client's timeout per attempt: past it a request is hung
RETRIES = 10  # 0.5 s doubling to 8 s (or Retry-After if longer): ~55 s, past a reference restart


@dataclass(frozen=True)
class StreamSpec:
    """One stream of requests to one gateway."""

    name: str
    domain: str  # the pool: prompts are compared within a domain
    gateway: str  # the gateway's process name in ``up``'s state
    rate: float  # requests per second
    tenants: int
    questions: int  # distinct prompts per tenant
    system_blocks: int  # blocks of the tenant's shared prefix
    question_blocks: int
    block: int  # tokens per hash id
    output_tokens: int
    cut: int = 40  # tokens cut off the last block (a partial last chunk, as in real prompts)
    headers: Mapping[str, str] = field(default_factory=dict)
    warm: bool = True  # its first rows visit every prompt once, in order
    seed: int = 0

    @property
    def prompts(self) -> int:
        return self.tenants * self.questions

    @property
    def warmup_s(self) -> float:
        """Until every prompt has been sent once (0 for a stream that does not warm)."""
        return self.prompts / self.rate if self.warm else 0.0

    def hash_ids(self, tenant: int, question: int) -> list[int]:
        s0 = 1_000_000 * (self.seed + 1) + tenant * 1000
        system = [s0 + k for k in range(self.system_blocks)]
        q0 = 2_000_000 * (self.seed + 1) + (tenant * self.questions + question) * 100
        return system + [q0 + k for k in range(self.question_blocks)]

    def rows(self, duration_s: float) -> list[dict[str, object]]:
        """Mooncake-format rows over ``duration_s``: Poisson arrivals at ``rate``; the first
        ``prompts`` rows (``warm``) visit every prompt in order, then prompts at random."""
        rng = random.Random(f"{self.name}:{self.seed}")
        order = [(t, q) for q in range(self.questions) for t in range(self.tenants)]
        length = (self.system_blocks + self.question_blocks) * self.block - self.cut
        rows: list[dict[str, object]] = []
        t = 0.0
        while t < duration_s:
            n = len(rows)
            tenant, question = order[n] if self.warm and n < len(order) else rng.choice(order)
            rows.append(
                {
                    "timestamp": round(t * 1000),
                    "input_length": length,
                    "output_length": self.output_tokens,
                    "hash_ids": self.hash_ids(tenant, question),
                }
            )
            t += rng.expovariate(self.rate)
        return rows


def write_trace(path: Path, rows: Sequence[Mapping[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@dataclass
class Stream:
    """A stream's jobs, each job's prompt, and its replay once started."""

    spec: StreamSpec
    jobs: list[Job]
    keys: dict[int, PromptKey]  # job index -> prompt
    max_tokens: dict[int, int]  # job index -> tokens the answer must have
    replay: Replay | None = None

    @property
    def outcomes(self) -> list[Outcome]:
        return [] if self.replay is None else self.replay.outcomes

    def start(self, url: str) -> Replay:
        endpoint = Endpoint(
            url,
            headers=dict(self.spec.headers),
            timeout_s=TIMEOUT_S,
            concurrency=64,
            retries=RETRIES,
            keep_text=True,
        )
        self.replay = Replay(endpoint, self.jobs, progress_every_s=3600)
        return self.replay


def build_stream(
    spec: StreamSpec,
    trace: Path,
    model: str,
    window: Window | None = None,
    time_scale: float = 1.0,
    max_output: int | None = None,
) -> Stream:
    """The jobs of ``trace`` (any Mooncake-format file) for ``spec``'s gateway; ``max_output``
    caps each answer's length (a real trace's answers are hundreds of tokens)."""
    loaded = load_trace(str(trace), "mooncake", window)
    reqs = [r for r in loaded.requests if isinstance(r, TraceRequest)]
    if max_output is not None:
        cap = max_output
        reqs = [dataclasses.replace(r, output_length=min(r.output_length, cap)) for r in reqs]
    loaded = Loaded(loaded.source, "mooncake", reqs)
    builder = prompt_builder(loaded, load_tokenizer(REFERENCE_TOKENIZER_DIR), spec.block)
    jobs = make_jobs(loaded, builder, model, time_scale=time_scale)
    keys = {r.index: (spec.domain, r.hash_ids, r.input_length, r.output_length) for r in reqs}
    max_tokens = {r.index: max(1, r.output_length) for r in reqs}
    return Stream(spec, jobs, keys, max_tokens)


def complete(stream: Stream, o: Outcome) -> bool:
    """An answer the client may take as whole: no error, the stream's ``[DONE]``, and every
    token asked for (``ignore_eos``: exactly ``max_tokens``)."""
    return o.error is None and o.done and o.output_tokens == stream.max_tokens[o.index]
