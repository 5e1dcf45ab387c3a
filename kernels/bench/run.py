"""Run the kernels benchmarks (layouts, CacheGen, CacheBlend) and write one JSON + table.

Each part lives in its own module exposing ``run(quick: bool) -> dict`` with keys metrics,
ratios, peers and markdown; this script merges them into ``bench-results/kernels.json`` in the
shape DESIGN.md fixes and prints the Markdown tables.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

PARTS = ("layouts_bench", "cachegen_bench", "blend_bench")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="reduced sizes, same ratios")
    ap.add_argument("--out", default="bench-results/kernels.json")
    ap.add_argument("--only", choices=PARTS, action="append", help="run only these parts")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    result: dict[str, Any] = {
        "component": "kernels",
        "quick": args.quick,
        "metrics": {},
        "ratios": {},
        "peers": {},
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "threads": 1,
        },
    }
    tables = []
    for name in args.only or PARTS:
        print(f"[kernels bench] {name} ...", flush=True)
        t0 = time.monotonic()
        part = importlib.import_module(name).run(args.quick)
        for key in ("metrics", "ratios", "peers"):
            result[key].update(part.get(key, {}))
        tables.append(f"### {name}\n\n{part['markdown']}\n")
        print(f"[kernels bench] {name} done in {time.monotonic() - t0:.0f}s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print("\n".join(tables))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
