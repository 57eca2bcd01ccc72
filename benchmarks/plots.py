"""The benchmark plots, drawn from the committed results: `python -m benchmarks.plots` redraws every PNG.

    python -m benchmarks.plots                           # every plot from benchmarks/results/
    python -m benchmarks.plots --only fused_head         # one plot
    python -m benchmarks.plots --results /tmp/b --out /tmp/b

Each plot reads only CSV (and JSON, for the date and machine) files of a results folder, so a plot
is a function of committed data: re-running a benchmark rewrites its CSV, and `redraw_for(stem)`
(called by the scripts after they write) redraws the plots that read it. Without matplotlib
(`pip install -e '.[bench]'`) nothing is drawn and nothing fails.

    fused_head.png    time against peak memory per provider, fused LM head (bench_linear), V = 32k and 152k
    grpo_step.png     one GRPO loss step per provider (bench_grpo): time ÷ the naive compiled step, memory
    trainer_step.png  the trainer-step sweep (trainer_step.csv: H, N, provider, time, peak memory, ops)
    branches.png      lossfx against the dense baseline per branch (LOGPROB, filtered: NeMo RL's sort-based
                      top-k/top-p, reverse KL, distillation, packed), fwd + bwd at [1, 2048, 151936] fp32
    logprob.png       the LOGPROB benchmark's own plot (`benchmarks.run.plot`, from logprob.json)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MACHINE = "2-core AMD EPYC VM, 1 thread"
# the trainer-step CSV's columns may be named any of these (first found wins)
ALIASES: dict[str, tuple[str, ...]] = {
    "provider": ("provider", "name", "method"),
    "N": ("N", "tokens", "n"),
    "H": ("H", "hidden", "h"),
    "V": ("V", "vocab", "v"),
    "dtype": ("dtype",),
    "time_ms": ("time_ms", "median_ms", "ms"),
    "time_s": ("time_s", "median_s", "seconds"),
    "peak_mib": ("peak_mib", "peak_extra_mib", "peak_memory_mib", "peak_rss_mib", "memory_mib"),
    "peak_bytes": ("peak_bytes", "peak_extra_bytes", "peak_memory_bytes"),
    "ops": ("ops", "launches", "kernel_launches", "aten_ops", "op_count"),
}


def _number(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def read_csv(path: Path) -> list[dict[str, str]]:
    """Rows of a CSV file (no file: no rows)."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def run_date(results: Path, *stems: str) -> str:
    """The dates (day only, distinct, sorted) of the runs behind `stems`: from the JSON's
    `environment.date`, else from a `date` column of the CSV."""
    days = set()
    for stem in stems:
        date = None
        jpath = results / f"{stem}.json"
        if jpath.is_file():
            date = json.loads(jpath.read_text()).get("environment", {}).get("date")
        if date is None:
            date = next((r.get("date") for r in read_csv(results / f"{stem}.csv") if r.get("date")), None)
        if date:
            days.add(str(date)[:10])
    return ", ".join(sorted(days)) or "date not recorded"


def cpu_of(results: Path, *stems: str, default: str = "2-core VM") -> str:
    """The CPU model(s) the JSONs of `stems` record (`environment.cpu_model`), else the 2-core VM."""
    models = set()
    for stem in stems:
        jpath = results / f"{stem}.json"
        if jpath.is_file():
            env = json.loads(jpath.read_text()).get("environment", {})
            if env.get("cpu_model"):
                models.add(f"2-core {env['cpu_model']} VM".replace("(R)", "").replace(" Processor", ""))
    return " / ".join(sorted(models)) or default


def provenance(results: Path, stems: Iterable[str]) -> str:
    """`"2026-11-29 Intel Xeon: logprob; 2026-12-02 AMD EPYC: divergence, ..."`: the day and CPU of
    each stem's run (JSON `environment`, else the CSV's `date` / `cpu_model` columns)."""
    groups: dict[str, list[str]] = {}
    for stem in stems:
        env: dict[str, Any] = {}
        jpath = results / f"{stem}.json"
        if jpath.is_file():
            env = json.loads(jpath.read_text()).get("environment", {}) or {}
        row = next(iter(read_csv(results / f"{stem}.csv")), {})
        date = str(env.get("date") or row.get("date") or "date not recorded")[:10]
        cpu = str(env.get("cpu_model") or row.get("cpu_model") or "CPU not recorded")
        cpu = cpu.replace("(R)", "").replace(" Processor", "")
        threads = re.search(r"(\d+) threads?", str(env.get("machine") or row.get("machine") or ""))
        cpu += f", {threads.group(1)} thread{'s' if threads.group(1) != '1' else ''}" if threads else ""
        groups.setdefault(f"{date} {cpu}", []).append(stem)
    return "; ".join(f"{key}: {', '.join(names)}" for key, names in groups.items())


def pick(row: dict[str, str], field: str) -> float | str | None:
    """`field` of a row under any of its aliases: a number where it parses, else the text."""
    for key in ALIASES.get(field, (field,)):
        if key in row and row[key] not in ("", None):
            x = _number(row[key])
            return x if x is not None else row[key]
    return None


def sweep_rows(rows: Iterable[dict[str, str]]) -> list[dict[str, Any]]:
    """Normalise rows to `provider, N, H, V, dtype, time_ms, peak_mib, ops` (missing: None)."""
    out = []
    for row in rows:
        time_ms = pick(row, "time_ms")
        if not isinstance(time_ms, float):
            seconds = pick(row, "time_s")
            time_ms = seconds * 1e3 if isinstance(seconds, float) else None
        peak = pick(row, "peak_mib")
        if not isinstance(peak, float):
            nbytes = pick(row, "peak_bytes")
            peak = nbytes / 2**20 if isinstance(nbytes, float) else None
        ops = pick(row, "ops")
        norm = {k: pick(row, k) for k in ("provider", "N", "H", "V", "dtype")}
        norm.update(time_ms=time_ms, peak_mib=peak, ops=ops if isinstance(ops, float) else None)
        norm.update({k: v if _number(v) is None else _number(v) for k, v in row.items() if k not in norm})
        if norm["provider"] is not None:
            out.append(norm)
    return out


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain() -> Any:
    """Tick labels as plain numbers (`0.5`, `2`, `1,000`) on a log axis."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:,.10g}")


def _fmt_dim(name: str, value: Any) -> str:
    return f"{name}={int(value):,}" if isinstance(value, float) and value.is_integer() else f"{name}={value}"


def plot_sweep(
    rows: list[dict[str, Any]],
    path: Path,
    title: str,
    metrics: tuple[tuple[str, str], ...] = (
        ("time_ms", "time per step (ms)"),
        ("peak_mib", "peak extra memory (MiB)"),
        ("ops", "kernel launches / aten ops per step"),
    ),
) -> bool:
    """One panel per metric present in `rows` (normalised by `sweep_rows`), plotted against the
    swept dimension (of N, H, V the one with the most values), one line per provider and each
    combination of the other dimensions; log axes. False when there is nothing to draw."""
    metrics = tuple((k, label) for k, label in metrics if any(isinstance(r.get(k), float) for r in rows))
    if not rows or not metrics:
        return False
    dims = [d for d in ("N", "H", "V") if any(r.get(d) is not None for r in rows)]
    counts = {d: len({r.get(d) for r in rows}) for d in dims}
    axis = max(dims, key=lambda d: counts[d]) if dims else None
    others = [d for d in dims if d != axis and counts[d] > 1]
    if len({r.get("dtype") for r in rows}) > 1:
        others.append("dtype")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics) + 2.2, 4.6), squeeze=False)
    lines: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        label = " ".join([str(r["provider"])] + [_fmt_dim(d, r.get(d)) for d in others])
        lines.setdefault(label, []).append(r)
    # colour: the provider; marker: the combination of the other dimensions
    providers = list(dict.fromkeys(str(r["provider"]) for r in rows))
    combos = list(dict.fromkeys(tuple(r.get(d) for d in others) for r in rows))
    cmap = plt.get_cmap("tab10" if len(providers) <= 10 else "tab20")

    def colour(label: str) -> Any:
        return cmap(providers.index(str(lines[label][0]["provider"])) % cmap.N)

    def marker(label: str) -> str:
        return "osD^vP*Xph"[combos.index(tuple(lines[label][0].get(d) for d in others)) % 10]

    swept = axis is not None and counts[axis] > 1
    for ax, (key, ylabel) in zip(axes[0], metrics):
        if not swept:  # one configuration: a bar per line
            labels = [label for label, pts in lines.items() if isinstance(pts[0].get(key), float)]
            values = [lines[label][0][key] for label in labels]
            colours = [colour(label) for label in labels]
            bars = ax.barh(range(len(labels)), values, color=colours)
            ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=2)
            ax.set_yticks(range(len(labels)), labels, fontsize=8)
            ax.invert_yaxis()
            if max(values) > 10 * min(v for v in values if v > 0):
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(_plain())
            ax.margins(x=0.12)
            ax.set_xlabel(ylabel)
            ax.grid(True, axis="x", which="both", alpha=0.3)
            continue
        for label, pts in lines.items():
            pts = sorted((p for p in pts if isinstance(p.get(key), float)), key=lambda p: p.get(axis) or 0)
            if not pts:
                continue
            xs = [p[axis] for p in pts]
            ys = [max(p[key], 1e-3) for p in pts]
            lossfx = "lossfx" in label
            style = {"ls": "-" if lossfx else "--", "lw": 2 if lossfx else 1}
            ax.plot(xs, ys, marker=marker(label), color=colour(label), label=label, **style)
        ax.set_xscale("log")
        ticks = sorted({p[axis] for p in rows if isinstance(p.get(axis), float)})
        ax.set_xticks(ticks, [f"{int(t):,}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel({"N": "N (tokens per step)", "H": "H (hidden size)", "V": "V (vocabulary)"}[axis or "V"])
        values = [p[key] for p in rows if isinstance(p.get(key), float) and p[key] > 0]
        if values and max(values) > 5 * min(values):  # a wide range: log axis
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(_plain())
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    if not swept:
        fixed = ", ".join(_fmt_dim(d, rows[0].get(d)) for d in dims)
        fig.suptitle(title + (f"\n({fixed})" if fixed else ""), fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return True
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- fused LM head: time against memory -------------------------------------------------------------

FUSED_STYLE = {  # provider -> (colour, label)
    "linear-eager": ("tab:blue", "lossfx linear_token_logprobs, eager"),
    "linear-compiled": ("tab:cyan", "lossfx linear_token_logprobs, compiled"),
    "objective-eager": ("tab:green", "lossfx linear_logprob_objective, eager"),
    "objective-compiled": ("tab:olive", "lossfx linear_logprob_objective, compiled"),
    "unfused-compiled": ("tab:gray", "h @ Wᵀ, then lossfx token_logprobs (compiled)"),
    "naive-compiled": ("black", "h @ Wᵀ, log_softmax + gather (compiled)"),
    "cce-compiled": ("tab:red", "Cut Cross-Entropy, torch_compile impl"),
    "torch-linear-ce": ("tab:purple", "F.linear_cross_entropy"),
}
DTYPE_MARKER = {"fp32": ("o", "full"), "bf16": ("s", "none")}


def fused_head(results: Path, out: Path) -> bool:
    """`fused_head.png`: median time against peak memory beyond the returned gradients (× the fp32
    logits), per provider and dtype, one panel per vocabulary; from `linear.csv`, `linear_151936.csv`."""
    stems = [s for s in ("linear", "linear_151936") if (results / f"{s}.csv").is_file()]
    rows = [r for s in stems for r in read_csv(results / f"{s}.csv")]
    if not rows:
        return False
    by_vocab: dict[int, list[dict[str, str]]] = {}
    for r in rows:
        by_vocab.setdefault(int(r["vocab"]), []).append(r)
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(by_vocab), figsize=(6.2 * len(by_vocab), 5.2), squeeze=False)
    for ax, (vocab, group) in zip(axes[0], sorted(by_vocab.items())):
        for r in group:
            colour, _ = FUSED_STYLE.get(r["provider"], ("tab:brown", r["provider"]))
            marker, fill = DTYPE_MARKER.get(r["dtype"], ("^", "full"))
            x = max(float(r["beyond_grads_x_logits"]), 1e-3)
            ax.plot(x, float(r["median_ms"]) / 1e3, marker=marker, ms=9, color=colour, fillstyle=fill, mew=2, ls="none")
        ax.axvline(0.1, color="k", ls=":", lw=1)
        ax.text(0.1, 1.0, " memory goal 0.1×", transform=ax.get_xaxis_transform(), fontsize=8, va="top")
        ax.set_xscale("log")
        ax.set_xlim(1e-3 * 0.8, 3)
        ax.set_xlabel("peak memory beyond dhidden + dweight (× the fp32 logits N·V·4)")
        ax.set_ylabel("median time, forward + backward (s)")
        n, h = group[0]["tokens"], group[0]["hidden"]
        ax.set_title(f"N = {int(n):,}, H = {int(h)}, V = {vocab:,}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    handles = [
        plt.Line2D([], [], color=c, marker="o", ls="none", label=label)
        for p, (c, label) in FUSED_STYLE.items()
        if any(r["provider"] == p for r in rows)
    ]
    handles += [
        plt.Line2D([], [], color="k", marker=m, fillstyle=f, ls="none", label=d) for d, (m, f) in DTYPE_MARKER.items()
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(
        f"Fused LM head (bench_linear): time vs memory per provider, side by side in one run per V\n"
        f"CPU: {MACHINE}, torch 2.13.0+cpu; measured {run_date(results, *stems)}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(out / "fused_head.png", dpi=110)
    plt.close(fig)
    return True


# -- the GRPO step and the trainer-step sweep --------------------------------------------------------


def grpo_step(results: Path, out: Path) -> bool:
    """`grpo_step.png`: time ÷ the naive compiled step of the same run, and memory beyond the
    returned gradients, per provider against V; from `grpo.csv`, with the rows of `grpo_151936.csv`
    (a later run at V = 151,936) replacing those it repeats."""
    rows = read_csv(results / "grpo.csv")
    later = read_csv(results / "grpo_151936.csv")
    replaced = {(r["provider"], r["vocab"]) for r in later}
    rows = [r for r in rows if (r["provider"], r["vocab"]) not in replaced] + later
    if not rows:
        return False
    stems = [s for s in ("grpo", "grpo_151936") if (results / f"{s}.csv").is_file()]
    n, h = rows[0]["tokens"], rows[0]["hidden"]
    # rows may say which clock their ratio is on (`time_clock`: wall, or thread CPU under load)
    other = [r for r in rows if r.get("time_clock") and "wall" not in r["time_clock"]]
    clock_note = ""
    if other:
        clock = other[0]["time_clock"]
        names = ", ".join(dict.fromkeys(r["provider"] for r in other))
        clock_note = f"\ntime ratios on the wall clock, except {clock}: {names} at V = {int(other[0]['vocab']):,}"
    return plot_sweep(
        sweep_rows(rows),
        out / "grpo_step.png",
        f"One GRPO loss step (bench_grpo), N = {int(n):,}, H = {h}, fp32, forward + backward\n"
        f"CPU: {MACHINE}, torch 2.13.0+cpu; measured {run_date(results, *stems)}{clock_note}",
        metrics=(
            ("time_vs_naive", "time ÷ naive compiled step (same run)"),
            ("beyond_grads_x_logits", "peak beyond dhidden + dweight (× fp32 logits)"),
        ),
    )


def long_rows(rows: Iterable[dict[str, str]], providers: tuple[str, ...]) -> list[dict[str, str]]:
    """A wide row (`{p}_ops`, `{p}_s_1t`, `{p}_mib_beyond_grads` per provider `p`, as
    benchmarks/bench_trainer_step.py writes) as one row per provider; long rows pass unchanged."""
    out = []
    for row in rows:
        if "provider" in row:
            out.append(row)
            continue
        shared = {k: v for k, v in row.items() if not k.startswith(tuple(f"{p}_" for p in providers))}
        for p in providers:
            fields = {
                "ops": row.get(f"{p}_ops"),
                "time_s": row.get(f"{p}_s_1t"),
                "peak_mib": row.get(f"{p}_mib_beyond_grads"),
            }
            out.append({**shared, "provider": p, **{k: v for k, v in fields.items() if v is not None}})
    return out


def trainer_step(results: Path, out: Path) -> bool:
    """`trainer_step.png` from `trainer_step.csv` (any of `ALIASES`' column names; absent ones skipped)."""
    rows = sweep_rows(long_rows(read_csv(results / "trainer_step.csv"), ("lossfx", "stock")))
    return plot_sweep(
        rows,
        out / "trainer_step.png",
        f"Trainer step sweep (trainer_step.csv)\nCPU: {cpu_of(results, 'trainer_step', default=MACHINE)}; measured "
        f"{run_date(results, 'trainer_step')}",
    )


# -- per branch: lossfx against the dense computation -------------------------------------------------

# branch -> (csv stem, row filter, time column, time unit in s, memory column, {provider: role})
BRANCHES: dict[str, tuple[str, Callable[[dict[str, str]], bool], str, float, str, dict[str, str]]] = {
    "LOGPROB": (
        "logprob",
        lambda r: r["case"] == "1x2048x151936" and r["dtype"] == "fp32" and r["mode"] == "fwd+bwd",
        "median_ms",
        1e-3,
        "peak_vs_logits",
        {"lossfx-eager": "lossfx eager", "lossfx-compiled": "lossfx compiled",
         "naive-eager": "baseline eager", "naive-compiled": "baseline compiled"},
    ),
    "top-k 50,\ntop-p 0.9": (
        "filtering",
        lambda r: True,
        "median_s",
        1.0,
        "peak_extra_x_logits",
        {"lossfx-eager": "lossfx eager", "lossfx-compiled": "lossfx compiled", "sort-dense": "baseline eager"},
    ),
    "reverse KL\n(fixed teacher)": (
        "divergence",
        lambda r: True,
        "median_s",
        1.0,
        "peak_extra_x_logits",
        {"lossfx-eager": "lossfx eager", "lossfx-compiled": "lossfx compiled",
         "dense-eager": "baseline eager", "dense-compiled": "baseline compiled"},
    ),
    "DISTILLATION\ntop-64 + H_all": (
        "distillation",
        lambda r: True,
        "median_s",
        1.0,
        "peak_extra_x_logits",
        {"lossfx-eager": "lossfx eager", "lossfx-compiled": "lossfx compiled",
         "dense-eager": "baseline eager", "dense-compiled": "baseline compiled"},
    ),
    "packed\n(8 sequences)": (
        "packing",
        lambda r: True,
        "median_s",
        1.0,
        "peak_extra_x_logits",
        {"packed-eager": "lossfx eager", "packed-compiled": "lossfx compiled",
         "unpack-then-unpacked-eager": "baseline eager", "unpack-then-unpacked-compiled": "baseline compiled"},
    ),
}  # fmt: skip
ROLES = {
    "lossfx eager": "tab:blue",
    "lossfx compiled": "tab:cyan",
    "baseline eager": "tab:red",
    "baseline compiled": "tab:orange",
}


def branches(results: Path, out: Path) -> bool:
    """`branches.png`: per branch, time (s) and peak extra memory (× the logits) of lossfx eager and
    compiled against the dense baseline (full-vocabulary log_softmax; for top-k/top-p NeMo RL's
    sort-based `apply_top_k_top_p`; for packing, unpack then the unpacked path)."""
    table: dict[str, dict[str, tuple[float, float]]] = {}
    stems = []
    for branch, (stem, keep, tcol, unit, mcol, roles) in BRANCHES.items():
        for r in read_csv(results / f"{stem}.csv"):
            t, m = _number(r.get(tcol)), _number(r.get(mcol))
            if keep(r) and r.get("provider") in roles and t is not None and m is not None:
                table.setdefault(branch, {})[roles[r["provider"]]] = (t * unit, m)
                stems.append(stem)
    if not table:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.8))
    width = 0.8 / len(ROLES)
    for ax, which, ylabel in (
        (axes[0], 0, "median time, forward + backward (s)"),
        (axes[1], 1, "peak extra memory (× the logits)"),
    ):
        for k, (role, colour) in enumerate(ROLES.items()):
            xs = [i + (k - (len(ROLES) - 1) / 2) * width for i in range(len(table))]
            ys = [table[b].get(role, (math.nan, math.nan))[which] for b in table]
            bars = ax.bar(xs, ys, width, color=colour, label=role)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        ax.set_xticks(range(len(table)), list(table), fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].yaxis.set_major_formatter(_plain())
    axes[0].yaxis.set_minor_formatter(_plain())
    axes[0].tick_params(axis="y", which="minor", labelsize=7)
    axes[1].axhline(1.0, color="k", ls=":", lw=1, label="the returned gradient alone (1×)")
    axes[0].legend(fontsize=8, loc="upper left")
    axes[1].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "lossfx against the dense baseline per branch (top-k/top-p: NeMo RL's sort-based apply_top_k_top_p;\n"
        "packed: unpack, then the unpacked path), [1, 2048, 151936] fp32, forward + backward\n"
        + textwrap.fill(f"2-core VM, torch 2.13.0+cpu; measured {provenance(results, dict.fromkeys(stems))}", 140),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out / "branches.png", dpi=110)
    plt.close(fig)
    return True


def logprob(results: Path, out: Path) -> bool:
    """`logprob.png`: the LOGPROB benchmark's plot, from `logprob.json`."""
    path = results / "logprob.json"
    if not path.is_file():
        return False
    from benchmarks import run

    doc = json.loads(path.read_text())
    return run.plot(doc["rows"], out / "logprob.png", doc.get("environment"))


# plot name -> (the result stems it reads, the function drawing it)
PLOTS: dict[str, tuple[tuple[str, ...], Callable[[Path, Path], bool]]] = {
    "fused_head": (("linear", "linear_151936"), fused_head),
    "grpo_step": (("grpo", "grpo_151936"), grpo_step),
    "trainer_step": (("trainer_step",), trainer_step),
    "branches": (("logprob", "filtering", "divergence", "distillation", "packing"), branches),
    "logprob": (("logprob",), logprob),
}


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def redraw(results: Path = RESULTS, out: Path | None = None, only: Iterable[str] | None = None) -> list[str]:
    """Draw the plots `only` (default all) from `results` into `out` (default `results`); the names
    of those drawn. Without matplotlib: none, and a note on stderr."""
    if not have_matplotlib():
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')", file=sys.stderr)
        return []
    out = out or results
    out.mkdir(parents=True, exist_ok=True)
    return [name for name in (only or PLOTS) if PLOTS[name][1](results, out)]


def redraw_for(stem: Path | str) -> list[str]:
    """After a benchmark wrote `<stem>.csv`: redraw the plots that read it, beside it. Never raises
    (a plot is a by-product of the run, not its result)."""
    stem = Path(stem)
    names = [name for name, (stems, _) in PLOTS.items() if stem.name in stems]
    if not names or not have_matplotlib():
        return []
    try:
        return redraw(stem.parent, only=names)
    except Exception as err:  # reported, never fatal
        print(f"plots not redrawn ({type(err).__name__}: {err})", file=sys.stderr)
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the result CSV/JSON files")
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: --results)")
    parser.add_argument("--only", nargs="+", choices=list(PLOTS), default=None)
    args = parser.parse_args(argv)
    if not have_matplotlib():
        print("matplotlib is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 1
    drawn = redraw(args.results, args.out, args.only)
    for name in args.only or PLOTS:
        print(f"{name}.png: {'drawn' if name in drawn else 'no data, not drawn'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
