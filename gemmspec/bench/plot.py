"""`--plot FILE.png`: each case's rates relative to gemmspec's, as grouped bars; with
`--sweep`, time against token count per system beside the HBM floor, log-log (needs
matplotlib)."""

from __future__ import annotations

import math
import sys

from .card import tbs_text


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("gemmspec bench: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def sweep_series(summary: dict) -> dict[str, list[tuple[int, float]]]:
    """(tokens, us) per system of a sweep's summary, the floor as "HBM floor"; points a
    system did not time (failed, NaN) are left out of its line."""
    series: dict[str, list[tuple[int, float]]] = {}
    for p in summary["points"]:
        series.setdefault("HBM floor", []).append((p["tokens"], p["hbm_floor_us"]))
        for s in p.get("systems", []):
            if not math.isnan(s["us"]):
                series.setdefault(s["system"], []).append((p["tokens"], s["us"]))
    return series


def plot_sweep(summary: dict, path: str) -> None:
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, pts in sweep_series(summary).items():
        xs, ys = zip(*pts)
        if label == "HBM floor":
            ax.plot(xs, ys, "k--", lw=1.2, label=f"HBM floor (bytes read / {tbs_text(summary['copy_rate_tbs'])} TB/s)")
        else:
            ax.plot(xs, ys, "o-", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("time (us)")
    ax.set_title(summary["sweep"], fontsize=8)
    ax.grid(True, which="both", lw=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(summary: list[dict], path: str) -> None:
    plt = _pyplot()
    if plt is None:
        return
    cases = [s for s in summary if "rows" in s]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 5))
    width = 0.28
    for i, s in enumerate(cases):
        ours = s["rows"][0]
        others = [r for r in s["rows"][1:]]
        base = ours["rate"]
        vals = [("gemmspec", 1.0)] + [(r["impl"].split(" ")[0], r["rate"] / base if ours["unit"] == "TFLOPS" else r["rate"] / base) for r in others]
        if s.get("deepgemm_recorded_tflops"):
            vals.append(("DeepGEMM (rec.)", s["deepgemm_recorded_tflops"] / base))
        for j, (label, v) in enumerate(vals):
            ax.bar(i + (j - 1) * width, v, width, color=["tab:blue", "tab:orange", "tab:gray"][j % 3],
                   label=label if i == 0 else None)
    ax.set_xticks(range(len(cases)), [s["case"].replace("_", "\n", 2) for s in cases], fontsize=7)
    ax.set_ylabel("rate relative to gemmspec")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
