"""The card a bench runs on: the HBM copy rate its memory-bound rows are judged against,
and whether the figures recorded on the reference card apply to it.

The targets are stated on one NVIDIA H200, whose measured copy rate is 4.2 TB/s, and the
recorded figures (DeepGEMM's rates of 2026-11-30, the decode rows' weights streamed alone)
were measured there. On an H200 the rows are judged against 4.2 TB/s, so verdicts stay
comparable across runs. On any other card (an H100's HBM3 copies about 3.0 TB/s) a share
of 4.2 TB/s would say nothing: the rows are judged against the copy rate measured in the
same run, and the recorded figures, which are another card's, are left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The reference card, and its measured HBM copy rate (bytes read plus written by a
# device-to-device copy), in TB/s.
REFERENCE_CARD = "H200"
REFERENCE_COPY_RATE_TBS = 4.2
# "NVIDIA H200" and its NVL form, not a GH200 (a Grace Hopper of other memory).
_REFERENCE_NAME = re.compile(r"(?<![A-Za-z0-9])H200(?![0-9])")
# The copy timed on each run: large enough that L2 (50 MB) holds a negligible part of it.
COPY_BYTES = 1 << 30


def tbs_text(tbs: float) -> str:
    """A copy rate as the table prints it: the reference rate as recorded, a measured one
    to two decimals."""
    return f"{tbs:g}" if tbs == REFERENCE_COPY_RATE_TBS else f"{tbs:.2f}"


@dataclass(frozen=True)
class Card:
    """`name`: the device's name as CUDA gives it; `measured_tbs`: this run's copy rate
    (None where it was not measured)."""

    name: str
    measured_tbs: float | None = None

    @property
    def is_reference(self) -> bool:
        """The targets' card, on which the recorded figures were measured."""
        return _REFERENCE_NAME.search(self.name) is not None

    @property
    def _judged_by_reference(self) -> bool:
        """Judged against the reference card's recorded rate: on that card, or where
        nothing was measured."""
        return self.is_reference or self.measured_tbs is None

    @property
    def copy_rate_tbs(self) -> float:
        """The rate memory-bound rows are judged against: the reference card's recorded
        rate on that card, this run's measured rate on any other."""
        return REFERENCE_COPY_RATE_TBS if self._judged_by_reference else self.measured_tbs

    def describe(self) -> str:
        """One line on the rate used and where it comes from."""
        measured = f"{self.measured_tbs:.2f} TB/s" if self.measured_tbs is not None else "not measured"
        if self._judged_by_reference:
            return (f"copy rate: {tbs_text(self.copy_rate_tbs)} TB/s, the {REFERENCE_CARD}'s recorded rate "
                    f"(this run's 1 GiB device-to-device copy: {measured})")
        return (f"copy rate: {tbs_text(self.copy_rate_tbs)} TB/s, this run's 1 GiB device-to-device copy "
                f"(the targets' {REFERENCE_COPY_RATE_TBS} TB/s is the {REFERENCE_CARD}'s; recorded "
                f"{REFERENCE_CARD} figures are not shown on this card)")


# The card the targets are stated on, for callers that judge without a device.
REFERENCE = Card(REFERENCE_CARD)


def measure_copy_rate(torch) -> float:
    """TB/s of a device-to-device copy of COPY_BYTES (bytes read plus written), the
    median of do_bench on the current device."""
    from triton.testing import do_bench

    def copy_ms() -> float:
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")

    ms = copy_ms()
    torch.cuda.empty_cache()  # the 2 GiB go back before the cases allocate
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e12
