"""Import time of lossfx on top of torch, in fresh processes.

    python -m benchmarks.bench_import                  # 15 fresh processes
    python -m benchmarks.bench_import --runs 31 --out benchmarks/results
    python -m benchmarks.bench_import --lossfx-root /tmp/before   # another checkout's lossfx

Each run is a new interpreter that times `import torch`, then `import lossfx` (what lossfx adds),
and, for scale, `import torch.distributed.tensor` after both (the module lossfx no longer imports
eagerly). Prints the median and the 20th/80th percentiles of each and the modules beyond the
standard library that `import lossfx` pulled in; `--out` also writes `import_time.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
before = set(sys.modules)
import lossfx
t2 = time.perf_counter()
added = sorted(m for m in set(sys.modules) - before if m.split(".")[0] not in sys.stdlib_module_names | {"lossfx"})
import torch.distributed.tensor
t3 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "lossfx": t2 - t1, "dtensor": t3 - t2, "added": added, "file": lossfx.__file__}))
"""


def probe(root: Path = ROOT) -> dict:
    """One fresh interpreter's timings (seconds) and the non-stdlib modules `import lossfx` added
    (the lossfx found under `root`)."""
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=root, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=5, method="inclusive") if len(values) > 1 else [values[0]] * 4
    return {"median_s": statistics.median(values), "p20_s": q[0], "p80_s": q[3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--lossfx-root", type=Path, default=ROOT, help="directory holding the lossfx to import")
    args = parser.parse_args()
    runs = [probe(args.lossfx_root) for _ in range(args.runs)]
    from benchmarks.measure import environment

    env = environment()
    env["load_average"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    result = {
        "environment": env,
        "runs": args.runs,
        "lossfx_root": str(args.lossfx_root),
        **{key: _summary([r[key] for r in runs]) for key in ("torch", "lossfx", "dtensor")},
        "modules_added_beyond_stdlib": runs[-1]["added"],
        "lossfx_file": runs[-1]["file"],
    }
    print(f"{env['date']}, {env['machine']}, {env['cpu_model']}, python {env['python']}, torch {env['torch']}")
    print(f"load average before the summary: {env['load_average']}; {args.runs} fresh processes")
    print("| import | median s | p20 s | p80 s |\n|---|---|---|---|")
    for key, label in (
        ("torch", "torch"),
        ("lossfx", "lossfx (added to torch)"),
        ("dtensor", "torch.distributed.tensor (after both)"),
    ):
        s = result[key]
        print(f"| {label} | {s['median_s']:.3f} | {s['p20_s']:.3f} | {s['p80_s']:.3f} |")
    print(f"lossfx imported from {result['lossfx_file']}")
    added = result["modules_added_beyond_stdlib"]
    packages = sorted({".".join(m.split(".")[:3]) if m.startswith("torch.") else m.split(".")[0] for m in added})
    print(f"modules beyond the standard library that `import lossfx` added: {len(added)} {packages}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "import_time.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
