"""The bench's table and its JSON summary: every case's rows, each row's ratio to
gemmspec's, its clock and power, the check it passed, and the case's verdict against
its target (with DeepGEMM's recorded figure where it did not run live). Rows judged
against the HBM copy rate (the decode rows) also show their share of it, and their case
the bytes it reads, the floor those bytes set at the copy rate and, where recorded, how
long its weights take streamed alone in the kernel's access pattern. The copy rate, and
whether the recorded figures are shown, come from the card the bench ran on (`card.py`).
"""

from __future__ import annotations

from dataclasses import asdict

from ..clocks import at_power_cap, peak_tflops
from .card import REFERENCE, Card, tbs_text
from .cases import CASES, STREAM_FLOOR_RECORDED, Case
from .timing import Result

# The verdict of a case whose target has a DeepGEMM ratio that could not be judged.
UNJUDGED_DEEPGEMM = "pass, DeepGEMM's ratio not judged (it did not run)"


def live_deepgemm(rows: list[Result]) -> Result | None:
    """The case's DeepGEMM row where DeepGEMM ran live and was timed (a failed anchor's
    row has no time)."""
    return next((r for r in rows if r.impl.startswith("DeepGEMM") and r.ms == r.ms), None)


def verdict(case: Case, ours: Result, torch_row: Result | None, others: list[Result] | None = None,
            card: Card = REFERENCE) -> str:
    """`others`: the case's rows beside gemmspec's first, which `vs_separate` compares
    with and among which a live DeepGEMM row is found for `vs_deepgemm`; `card`: whose
    copy rate a `copy_share` is of."""
    t = case.target
    ok = True
    judged_deepgemm = True
    if t.vs_deepgemm is not None:
        dg = live_deepgemm(others or [])
        judged_deepgemm = dg is not None
        ok &= dg is None or dg.ms / ours.ms >= t.vs_deepgemm
    if t.vs_separate is not None:
        # "Faster than" (1.0) is strict; a ratio (1.2x) is met at the ratio itself.
        ratios = [r.ms / ours.ms for r in others or []]
        ok &= bool(ratios) and all(q > 1.0 if t.vs_separate == 1.0 else q >= t.vs_separate for q in ratios)
    if t.tflops is not None:
        ok &= ours.rate >= t.tflops
    if t.copy_share is not None:
        ok &= ours.unit == "TB/s" and ours.rate >= t.copy_share * card.copy_rate_tbs
    if t.max_us is not None:
        ok &= ours.ms * 1e3 <= t.max_us
    if t.vs_torch is not None:
        ok &= torch_row is not None and torch_row.ms / ours.ms >= t.vs_torch
    if not ok:
        return "MISS"
    return "pass" if judged_deepgemm else UNJUDGED_DEEPGEMM


def _clock(r: Result) -> str:
    if r.sm_mhz is None:
        return f"{'':17}"
    cap = "*" if r.power_capped is not None and at_power_cap(r.power_capped) else " "
    power = f"{r.power_w:4.0f} W" if r.power_w is not None else f"{'':6}"
    return f"{r.sm_mhz:5.0f} MHz {power}{cap}"


def copy_share(r: Result, copy_rate_tbs: float) -> float:
    """A TB/s row's rate as a share of the HBM copy rate."""
    return r.rate / copy_rate_tbs


def hbm_floor_us(moved: float, copy_rate_tbs: float) -> float:
    """The time `moved` bytes take at the HBM copy rate, in microseconds."""
    return moved / (copy_rate_tbs * 1e12) * 1e6


def _rate(r: Result, share: bool, copy_rate_tbs: float) -> str:
    if not share:
        return f"{r.rate:7.1f} {r.unit:>4}"
    return f"{r.rate:7.2f} {r.unit:>4} {copy_share(r, copy_rate_tbs):4.0%} of {tbs_text(copy_rate_tbs)}"


def report(results: list[Result], failures: dict[str, str], sms: int | None = None,
           card: Card = REFERENCE) -> tuple[str, list[dict]]:
    """The table and its JSON summary; `sms`: the GPU's SM count, for each compute-bound
    row's peak at the clock it ran at; `card`: the copy rate the memory-bound rows are
    judged against, and whether the figures recorded on the reference card are shown."""
    rate = card.copy_rate_tbs
    lines = [
        f"{'case':36} {'impl':44} {'ms':>9} {'rate':>12} {'gemmspec/it':>11}  {'clock, power':17}  check",
    ]
    summary = []
    for case in CASES:
        rows = [r for r in results if r.case == case.name]
        if case.name in failures:
            lines.append(f"{case.name:36} FAILED: {failures[case.name]}")
            summary.append({"case": case.name, "error": failures[case.name]})
            continue
        if not rows:
            continue
        ours = rows[0]
        torch_row = next((r for r in rows[1:] if r.impl.startswith("torch")), None)
        share = case.target.copy_share is not None
        for r in rows:
            ratio = r.ms / ours.ms if r is not ours else 1.0
            lines.append(
                f"{case.name:36} {r.impl[:44]:44} {r.ms:9.4f} {_rate(r, share, rate)} "
                f"{ratio:10.2f}x  {_clock(r)}  {r.check}"
            )
        # The recorded figure stands in where no DeepGEMM row was timed (not installed, or
        # its anchor failed), the same test the verdict's DeepGEMM ratio takes; it is the
        # reference card's, so another card's table leaves it out.
        dg = None if live_deepgemm(rows) or not card.is_reference else case.deepgemm_recorded_tflops
        if dg:
            lines.append(f"{'':36} {'DeepGEMM 2.6.1 (recorded 2026-11-30)':44} {'':9} {dg:7.1f} TFLOPS {dg and ours.rate / dg:10.2f}x (gemmspec / it)")
        case_verdict = verdict(case, ours, torch_row, rows[1:], card)
        roof = None
        if case.peak and sms and ours.sm_mhz:
            roof = peak_tflops(case.peak, sms, ours.sm_mhz)
        at_clock = (
            f"; the {case.peak.upper()} peak at {ours.sm_mhz:.0f} MHz is {roof:.0f} TFLOPS: "
            f"{ours.rate / roof:.0%} of it" if roof else ""
        )
        floor = (
            f"; reads {ours.work / 1e6:.1f} MB: {hbm_floor_us(ours.work, rate):.1f} us at {tbs_text(rate)} TB/s"
            if share and ours.unit == "TB/s" else ""
        )
        stream_floor_us = case.stream_floor_us if card.is_reference else None
        if stream_floor_us is not None:
            floor += (f"; its weights streamed alone: {stream_floor_us:.1f} us "
                      f"(no math, after the flush; recorded {STREAM_FLOOR_RECORDED})")
        lines.append(f"{'':36} target {case.target.describe(rate)}: {case_verdict}{at_clock}{floor}")
        entry = {
            "case": case.name,
            "what": case.what,
            "target": case.target.describe(rate),
            "verdict": case_verdict,
            "deepgemm_recorded_tflops": dg,
            "peak_at_clock_tflops": roof,
            "rows": [asdict(r) | {"rate": r.rate} for r in rows],
        }
        if share:
            entry["bytes_read"] = ours.work
            entry["hbm_floor_us"] = hbm_floor_us(ours.work, rate)
            entry["stream_floor_us"] = stream_floor_us
            for d, r in zip(entry["rows"], rows):
                d["copy_share"] = copy_share(r, rate)
        summary.append(entry)
    return "\n".join(lines), summary
