"""Smoke tests of the benchmark scripts: each runs end to end on tiny shapes (no timing asserts).

The one quantitative check is the memory method's reason to exist: a compiled forward + backward
must be seen to allocate at least its returned gradient (the profiler's events read ~0 there).
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, *args, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_benchmark_quick_run_writes_results(tmp_path):
    _run(
        [str(ROOT / "benchmarks" / "run.py"), "--quick", "--no-plot", "--cases", "1x9x257", "--dtypes", "fp32"],
        tmp_path,
    )

    doc = json.loads((tmp_path / "logprob.json").read_text())
    assert {"date", "machine", "torch", "lossfx", "omp_num_threads"} <= set(doc["environment"])
    rows = doc["rows"]
    # every (case, dtype) has a read pass and both eager providers in both modes
    keys = {(r["case"], r["dtype"], r["provider"], r["mode"]) for r in rows}
    assert doc["config"]["cases"] == ["1x9x257"]
    for provider in ("lossfx-eager", "naive-eager"):
        for mode in ("fwd", "fwd+bwd"):
            assert ("1x9x257", "fp32", provider, mode) in keys
    assert ("1x9x257", "fp32", "read-pass", "fwd") in keys
    for r in rows:
        assert r["median_ms"] > 0
        if r["provider"] == "lossfx-eager":
            assert r["time_vs_naive"] > 0 and r["peak_extra_mb"] >= 0
    assert {t["target"] for t in doc["targets"]} >= {"eager fwd+bwd time < naive eager"}

    with open(tmp_path / "logprob.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert "| case | dtype |" in (tmp_path / "logprob.md").read_text()


def test_bench_memory_quick_counts_compiled_buffers(tmp_path):
    _run(["-m", "benchmarks.bench_memory", "--quick", "--paths", "logprob", "--dtypes", "fp32"], tmp_path)

    rows = json.loads((tmp_path / "memory.json").read_text())["results"]
    assert [(r["path"], r["mode"]) for r in rows] == [("logprob", "eager"), ("logprob", "compiled")]
    for r in rows:
        # the returned gradient alone is 1x the logits: a method blind to compiled code reads ~0
        assert r["peak_x_logits"] is not None and r["peak_x_logits"] >= 0.9, r
        assert r["bound_x_logits"] == 1.1 and r["pass"] == (r["peak_x_logits"] <= 1.1)
    assert "| path | dtype | mode |" in (tmp_path / "memory.md").read_text()


@pytest.mark.slow  # two compiled providers, each also in a fresh process: minutes on a busy 2-core VM
def test_bench_linear_quick_runs(tmp_path):
    providers = ["linear-eager", "unfused-compiled"]
    flags = ["--quick", "--dtypes", "fp32", "--min-runs", "1", "--no-compile-time"]
    _run(["-m", "benchmarks.bench_linear", *flags, "--providers", *providers], tmp_path)

    doc = json.loads((tmp_path / "linear.json").read_text())
    measured = {r["provider"] for r in doc["results"]}
    assert measured | set(doc["skipped"]) == set(providers) and "unfused-compiled" in measured
    for r in doc["results"]:
        assert r["median_ms"] > 0 and r["peak_extra_mib"] >= 0 and r["time_vs_unfused"] > 0
    assert "| N | H | V |" in (tmp_path / "linear.md").read_text()


def _check_grpo_results(tmp_path, providers):
    doc = json.loads((tmp_path / "grpo.json").read_text())
    assert {"date", "machine", "torch", "trl", "liger", "cce"} <= set(doc["environment"])
    measured = {r["provider"] for r in doc["results"]}
    assert measured | set(doc["skipped"]) == set(providers) and measured
    for r in doc["results"]:
        assert r["median_ms"] > 0 and r["peak_extra_mib"] >= 0 and r["grad_norm"] > 0
    assert "| N | H | V | provider | entropy |" in (tmp_path / "grpo.md").read_text()
    return doc


def test_bench_grpo_quick_runs_eager_providers(tmp_path):
    providers = ["lossfx-fused", "trl-fused"]
    _run(["-m", "benchmarks.bench_grpo", "--quick", "--min-runs", "1", "--providers", *providers], tmp_path)
    doc = _check_grpo_results(tmp_path, providers)
    rows = {r["provider"]: r for r in doc["results"]}
    if "trl-fused" in rows:  # the same loss and gradient from every provider (fp32 rounding)
        for key in ("loss", "grad_norm"):
            assert abs(rows["trl-fused"][key] - rows["lossfx-fused"][key]) <= 1e-5 * abs(rows["lossfx-fused"][key])


@pytest.mark.slow  # every provider, compiled ones too, each also in a fresh process: minutes on 2 cores
def test_bench_grpo_quick_runs_every_provider(tmp_path):
    from benchmarks.bench_grpo import PROVIDERS

    _run(["-m", "benchmarks.bench_grpo", "--quick", "--min-runs", "1"], tmp_path)
    doc = _check_grpo_results(tmp_path, list(PROVIDERS))
    for r in doc["results"]:
        assert r["time_vs_naive"] > 0 and r["grad_norm_rel"] < 1e-4, r
