"""Build (once) the virtualenv in which the hash-parity oracles run lmcache next to the real vLLM.

With vLLM importable in the engine, lmcache 0.5.6 takes vLLM's hash functions and lets vLLM's own
``init_none_hash`` seed the chain from ``PYTHONHASHSEED`` (protocol/README.md, "Hashing regimes").
tests/unit/test_hashing_parity.py checks kvpool.protocol against exactly that, so it needs vLLM,
and vLLM must not enter the project's .venv (the reference engine runs without it). Hence
``.kvpool/vllm-venv`` (gitignored): the vLLM 0.33.0 wheel and the few packages that
``vllm.v1.core.kv_cache_utils`` and ``vllm.utils.hashing`` import, each without dependencies
(vLLM's own would pull torch 2.14 and a CUDA stack), on top of the project .venv's packages
(torch 2.13.0 CPU, lmcache 0.5.6 and what lmcache needs), which a ``.pth`` file puts after the
venv's own on ``sys.path``: the same torch and lmcache as the reference engine, not a second
2.5 GB copy of them. The venv is built once: a stamp holds a digest of what is listed here, and
a changed list, a missing stamp or a half-built venv means a fresh build (about a minute, most
of it the 336 MB vLLM wheel).

    python3 protocol/tests/vllm_venv.py           # build if needed (what `make vllm-venv` runs)
    python3 protocol/tests/vllm_venv.py --check   # exit 1, saying why, if it is not built

Stdlib only: the test runner and the Makefile call it with any Python 3.11.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".kvpool" / "vllm-venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".kvpool-vllm-venv"
LOCK = ROOT / ".kvpool" / "vllm-venv.lock"
#: What a person (or a failing test) runs to build it.
COMMAND = "make vllm-venv"

#: The project's own site-packages (torch 2.13.0 CPU, lmcache 0.5.6): after the venv's own.
PROJECT_SITE = (
    ROOT
    / ".venv"
    / "lib"
    / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    / ("site-packages")
)
VLLM = "vllm==0.33.0"
LMCACHE = "lmcache==0.5.6"  # what the project .venv pins (worker/pyproject.toml): checked below
#: Installed with --no-deps next to vLLM: what importing vllm.v1.core.kv_cache_utils and
#: vllm.utils.hashing needs beyond lmcache's dependencies, at the version vLLM 0.33.0 pins where
#: it pins one (xgrammar, apache-tvm-ffi, llguidance), else the release current when this was
#: written. Pinned, because a new release could need a dependency that --no-deps leaves out.
VLLM_IMPORT_DEPS = (
    "openai-harmony==0.0.8",
    "openai==3.57.0",
    "pybase64==1.5.1",
    "cloudpickle==3.1.3",
    "xgrammar==0.2.8",
    "apache-tvm-ffi==0.1.11",
    "partial-json-parser==0.2.1.1.post7",
    "llguidance==1.7.6",
    "cbor2==6.3.0",  # vllm.utils.hashing (sha256_cbor)
    "sniffio==1.3.1",  # openai
    "pillow==13.0.0",  # vllm.multimodal
    "uvloop==0.23.0",  # vllm.utils
)

#: Run by the venv's python after the install: the build fails unless this prints the versions.
_VERIFY = """
import importlib.metadata as md, json, torch
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
cuda = sorted(d.metadata["Name"] for d in md.distributions()
              if d.metadata["Name"].lower().startswith(("nvidia-", "triton")))
assert not cuda, f"CUDA packages in the venv: {cuda}"
assert md.version("lmcache") == LMCACHE_VERSION, md.version("lmcache")
import lmcache.v1.token_database, vllm.utils.hashing, vllm.v1.core.kv_cache_utils
assert hasattr(vllm.v1.core.kv_cache_utils, "init_none_hash")
print(json.dumps({n: md.version(n) for n in ("torch", "lmcache", "vllm")}))
"""


def spec_digest() -> str:
    """What the venv is built from; a stamp with another digest means a rebuild."""
    spec = [sys.version_info[:2], str(PROJECT_SITE), VLLM, *VLLM_IMPORT_DEPS]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()


def problem() -> str | None:
    """None when the venv is built from the current list, else why not and what to run."""
    if not PYTHON.exists():
        return f"{VENV} does not exist: run `{COMMAND}` (a cold build takes about a minute)"
    stamp = STAMP.read_text().strip() if STAMP.exists() else ""
    if stamp != spec_digest():
        return (
            f"{VENV} is half-built or from another package list: run `{COMMAND}` "
            "(it rebuilds it, about a minute)"
        )
    return None


def _pip(*args: str) -> None:
    cmd = [str(PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    print("+ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def build() -> None:
    """Build the venv from scratch (a partial one is removed first); the stamp goes last."""
    t0 = time.monotonic()
    print(f"kvpool: building {VENV} (lmcache 0.5.6 with the real vLLM 0.33.0, CPU)", flush=True)
    if not (PROJECT_SITE / "lmcache").is_dir():
        raise subprocess.CalledProcessError(
            1, "vllm_venv", stderr=f"{PROJECT_SITE} has no lmcache: run `make install` first"
        )
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    site = VENV / "lib" / PROJECT_SITE.parent.name / "site-packages"
    (site / "zz-kvpool-project.pth").write_text(f"{PROJECT_SITE}\n")
    _pip("--no-deps", VLLM, *VLLM_IMPORT_DEPS)
    verify = _VERIFY.replace("LMCACHE_VERSION", repr(LMCACHE.partition("==")[2]))
    versions = subprocess.run(
        [str(PYTHON), "-c", verify],
        check=True,
        capture_output=True,
        text=True,
        env={
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "PYTHONHASHSEED": "0",
            "LMCACHE_TRACK_USAGE": "false",
        },
    ).stdout.strip()
    STAMP.write_text(spec_digest() + "\n")
    size = sum(p.stat().st_size for p in VENV.rglob("*") if p.is_file() and not p.is_symlink())
    took = time.monotonic() - t0
    print(f"kvpool: built {VENV} in {took:.0f} s, {size / 2**30:.1f} GiB: {versions}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="only say whether it is built")
    args = parser.parse_args(argv)
    if args.check:
        why = problem()
        print(why or f"{VENV} is built")
        return 1 if why else 0
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runners at once: the second waits, then finds it
        if problem() is None:
            return 0
        try:
            build()
        except subprocess.CalledProcessError as exc:
            detail = exc.stderr.strip() if isinstance(exc.stderr, str) else ""
            print(
                f"kvpool: building {VENV} failed ({exc}){': ' + detail if detail else ''}\n"
                f"kvpool: the vLLM-regime hash-parity tests will fail until `{COMMAND}` succeeds",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
