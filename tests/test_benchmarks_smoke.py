"""Smoke tests of the benchmark scripts: each runs end to end on tiny shapes (no timing asserts).

The one quantitative check is the memory method's reason to exist: a compiled forward + backward
must be seen to allocate at least its returned gradient (the profiler's events read ~0 there).

Each script runs in a fresh single-threaded process; the runs of the selected tests start
together when the module starts, two at a time (on a 2-core machine the second core would
otherwise idle), and each test waits for its own run and checks its output. Under xdist the
module's tests form one group (`pytestmark`, `--dist loadgroup`): one worker starts the runs, once
(a worker that ran any test of the module started every selected run, so two workers ran each twice).
"""

import csv
import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

# one xdist worker runs the whole module, so the module fixture below starts each run once
pytestmark = pytest.mark.xdist_group("benchmark_smoke")

ROOT = Path(__file__).resolve().parent.parent
GRPO = ["-m", "benchmarks.bench_grpo", "--quick", "--min-runs", "1"]
GPU = ["-m", "benchmarks.gpu", "--smoke"]
# benchmarks/gpu.py: the GPU benchmark (the suite's call table timed, then the GRPO step), run on the
# CPU at tiny shapes (its --smoke configuration); its accuracy checks are the suite's (-m gpu_check)
GPU_EAGER_PROVIDERS = ["naive", "lossfx-logits", "lossfx-fused", "lossfx-objective", "torch-linear-ce", "liger-flce"]

# each test's command line (its name -> the arguments after the interpreter; "--out DIR" is added)
RUNS = {
    "test_benchmark_quick_run_writes_results": [
        str(ROOT / "benchmarks" / "run.py"), "--quick", "--no-plot", "--cases", "1x9x257", "--dtypes", "fp32"
    ],
    "test_bench_memory_quick_counts_compiled_buffers": [
        "-m", "benchmarks.bench_memory", "--quick", "--paths", "logprob", "--dtypes", "fp32"
    ],
    "test_bench_linear_quick_runs": [
        "-m", "benchmarks.bench_linear", "--quick", "--dtypes", "fp32", "--min-runs", "1", "--no-compile-time",
        "--providers", "linear-eager", "unfused-compiled",
    ],
    "test_bench_grpo_quick_runs_eager_providers[1]": [*GRPO, "--providers", "lossfx-fused"],
    "test_bench_grpo_quick_runs_eager_providers[2]": [*GRPO, "--providers", "lossfx-fused", "trl-fused"],
    "test_bench_grpo_quick_runs_every_provider": GRPO,
    "test_gpu_script_smoke_times_every_path_and_runs_the_bench": [*GPU, "--providers", *GPU_EAGER_PROVIDERS],
    "test_gpu_script_smoke_runs_every_provider": [*GPU, "--sections", "bench"],
}  # fmt: skip
_EXECUTOR = ThreadPoolExecutor(max_workers=2)
_STARTED: dict[str, Future] = {}


def _start(name: str, tmp_path_factory) -> Future:
    """The run of test `name` (started now unless it already is): `(completed process, out dir)`."""
    if name not in _STARTED:
        out = tmp_path_factory.mktemp(name.replace("[", "-").replace("]", ""))
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, *RUNS[name], "--out", str(out)]

        def run():
            return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900), out

        _STARTED[name] = _EXECUTOR.submit(run)
    return _STARTED[name]


@pytest.fixture(scope="module", autouse=True)
def _start_the_selected_runs(request, tmp_path_factory):
    for item in request.session.items:
        if getattr(item, "module", None) is request.module and item.name in RUNS:  # doctests have none
            _start(item.name, tmp_path_factory)


@pytest.fixture
def finished(request, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """This test's run, waited for: `(completed process, its --out directory)`."""
    return _start(request.node.name, tmp_path_factory).result()


def _ok(finished) -> Path:
    proc, out = finished
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


def test_benchmark_quick_run_writes_results(finished):
    tmp_path = _ok(finished)

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


def test_bench_memory_quick_counts_compiled_buffers(finished):
    tmp_path = _ok(finished)

    rows = json.loads((tmp_path / "memory.json").read_text())["results"]
    assert [(r["path"], r["mode"]) for r in rows] == [("logprob", "eager"), ("logprob", "compiled")]
    for r in rows:
        # the returned gradient alone is 1x the logits: a method blind to compiled code reads ~0
        assert r["peak_x_logits"] is not None and r["peak_x_logits"] >= 0.9, r
        assert r["bound_x_logits"] == 1.1 and r["pass"] == (r["peak_x_logits"] <= 1.1)
    assert "| path | dtype | mode |" in (tmp_path / "memory.md").read_text()


@pytest.mark.slow  # two compiled providers, each also in a fresh process: minutes on a busy 2-core VM
def test_bench_linear_quick_runs(finished):
    providers = ["linear-eager", "unfused-compiled"]
    tmp_path = _ok(finished)

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


# trl-fused (importing TRL is half the run) with -m slow, here and in the every-provider run below;
# lossfx against stock TRL by default: tests/test_examples.py, tests/test_integrations_trl.py
@pytest.mark.parametrize(
    "providers", [["lossfx-fused"], pytest.param(["lossfx-fused", "trl-fused"], marks=pytest.mark.slow)], ids=len
)
def test_bench_grpo_quick_runs_eager_providers(finished, providers):
    tmp_path = _ok(finished)
    doc = _check_grpo_results(tmp_path, providers)
    rows = {r["provider"]: r for r in doc["results"]}
    if "trl-fused" in rows:  # the same loss and gradient from every provider (fp32 rounding)
        for key in ("loss", "grad_norm"):
            assert abs(rows["trl-fused"][key] - rows["lossfx-fused"][key]) <= 1e-5 * abs(rows["lossfx-fused"][key])


@pytest.mark.slow  # every provider, compiled ones too, each also in a fresh process: minutes on 2 cores
def test_bench_grpo_quick_runs_every_provider(finished):
    from benchmarks.bench_grpo import PROVIDERS

    tmp_path = _ok(finished)
    doc = _check_grpo_results(tmp_path, list(PROVIDERS))
    for r in doc["results"]:
        assert r["time_vs_naive"] > 0 and r["grad_norm_rel"] < 1e-4, r


def _gpu(finished) -> tuple[subprocess.CompletedProcess, dict]:
    proc, out = finished
    return proc, json.loads((out / "gpu.json").read_text())


def test_gpu_script_smoke_times_every_path_and_runs_the_bench(finished):
    """Every path of the suite's call table gets a timed row, lossfx and torch side by side."""
    from call_table import LINEAR_PATHS, LOGITS_PATHS, TOKEN_PATHS

    from benchmarks.gpu import path_names

    proc, doc = _gpu(finished)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert doc["failures"] == []
    names = path_names()
    assert len(names) == len(TOKEN_PATHS) + len(LOGITS_PATHS) + len(LINEAR_PATHS) == 16
    assert [r["path"] for r in doc["paths"]] == names
    for r in doc["paths"]:
        assert "skipped" not in r, r
        assert r["lossfx"]["median_ms"] > 0 and r["torch"]["median_ms"] > 0 and r["time_vs_torch"] > 0, r
    bench = {r["provider"]: r for r in doc["bench"]}
    assert set(bench) == set(GPU_EAGER_PROVIDERS)
    reason = bench["liger-flce"]["skipped"]  # a Triton kernel: never on the CPU
    assert "CUDA only" in reason or "not installed" in reason, reason
    for provider, r in bench.items():
        if provider.startswith(("naive", "lossfx")) or "skipped" not in r:  # a peer may be absent
            assert r["median_ms"] > 0 and r["grad_norm"] > 0, r
            assert r["grad_norm_rel"] < 2e-2, r  # bf16: every provider forms the same gradient
    md = (finished[1] / "gpu.md").read_text()
    assert "| path | rows | V | lossfx ms | torch ms |" in md and "| N | H | V | provider | median ms |" in md


@pytest.mark.slow  # every provider, compiled ones and compiling peers: minutes on a busy 2-core VM
def test_gpu_script_smoke_runs_every_provider(finished):
    from benchmarks.gpu import BENCH_PROVIDERS

    proc, doc = _gpu(finished)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bench = {r["provider"]: r for r in doc["bench"]}
    assert set(bench) == set(BENCH_PROVIDERS)
    for r in bench.values():
        assert "skipped" in r or (r["median_ms"] > 0 and r["grad_norm_rel"] < 2e-2), r
