"""Smoke test of benchmarks/run.py: the script runs end to end on tiny shapes (no timing asserts)."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmark_quick_run_writes_results(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--no-plot", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    doc = json.loads((tmp_path / "logprob.json").read_text())
    assert {"date", "machine", "torch", "lossfx", "omp_num_threads"} <= set(doc["environment"])
    rows = doc["rows"]
    # every (case, dtype) has a read pass and both eager providers in both modes
    keys = {(r["case"], r["dtype"], r["provider"], r["mode"]) for r in rows}
    for case in doc["config"]["cases"]:
        for dtype in ("bf16", "fp32"):
            assert (case, dtype, "read-pass", "fwd") in keys
            for provider in ("lossfx-eager", "naive-eager"):
                for mode in ("fwd", "fwd+bwd"):
                    assert (case, dtype, provider, mode) in keys
    for r in rows:
        assert r["median_ms"] > 0
        if r["provider"] == "lossfx-eager":
            assert r["time_vs_naive"] > 0 and r["peak_vs_naive"] is not None
    assert {t["target"] for t in doc["targets"]} >= {"eager fwd+bwd time < naive eager"}

    with open(tmp_path / "logprob.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert "| case | dtype |" in (tmp_path / "logprob.md").read_text()
