#!/usr/bin/env python3
"""One K-grouped FP8 WGRAD launch without CTA pairs, on segments whose lengths force the
producer's by-hand copies (the path with generic shared-memory writes), for
`compute-sanitizer --tool racecheck` on a Hopper GPU:

    compute-sanitizer --tool racecheck python3 scripts/racecheck_one_cta.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemmspec  # noqa: E402
from gemmspec import bench  # noqa: E402
from gemmspec.runtime.verify import run_random  # noqa: E402

spec = bench.WGRAD.format(n=136, k=200, e=5).rstrip().rstrip("}") + "  tile(128, 128)\n}\n"
exe = gemmspec.build(spec)
print(exe.program.launches[0].gemm.name)
report = run_random(exe, lengths={"expert": [1, 127, 129, 0, 1000]}, seed=12, repeats=0)
print("matches the float64 reference:", report.ok)
sys.exit(0 if report.ok else 1)
