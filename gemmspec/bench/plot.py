"""`--plot FILE.png`: each case's rates relative to gemmspec's, as grouped bars (needs
matplotlib)."""

from __future__ import annotations

import sys


def plot(summary: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("gemmspec bench: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
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
