"""`gemmspec bench`: gemmspec beside the anchors, in one process, on one GPU.

Every row of the target table runs gemmspec and the anchors available here on the
same inputs: PyTorch's grouped and scaled GEMMs always (torch is needed for this
command only). Each gemmspec result is checked before it is timed (against the
anchor's output where the anchor computes the same function, otherwise against a
float64 reference of the dequantized inputs on sampled rows). Times are medians of
`triton.testing.do_bench` (CUDA events, L2 flushed between runs); TFLOPS count
useful FLOPs only (no padding), the memory-bound rows report TB/s of bytes that must
move. A row whose launches must each start from the same output (the scaled LoRA
expand's BF16 `+=`) restores it before every launch, untimed, and is timed by the
`--idle` event loop instead. Where `deep_gemm` is importable, DeepGEMM runs beside them on
the same inputs (its output checked against gemmspec's first; ragged groups copied once,
untimed, into the 128-row aligned layout it needs); elsewhere, or with `--no-deepgemm`,
DeepGEMM 2.6.1's figures measured on an H200 on 2026-11-30 are printed as recorded
references (on an H200 only). Where nvidia-smi is on the PATH, each row also shows the SM clock and board
power of its kernel kept running for a second after it is timed (a sustained FP8 GEMM
runs at the card's power cap, at a clock well below the maximum), and each compute-bound
case the share of the tensor cores' peak at the clock gemmspec's row ran at. The
decode rows (`--only decode`) are bound by HBM bandwidth: they report TB/s of the bytes
they must read and write and its share of the card's copy rate: the H200's 4.2 TB/s on an
H200, where the targets are stated, and on any other card the rate of a 1 GiB
device-to-device copy timed at the start of the run (`card.py`). `--sweep decode` times
one decode shape over token counts instead of the table (see `sweep.py`).

    gemmspec bench [--only NAME ...] [--repeat N] [--idle MS] [--json FILE] [--plot FILE.png] [--no-deepgemm]
    gemmspec bench --sweep decode [--repeat N] [--json FILE] [--plot FILE.png] [--no-deepgemm]
    python -m gemmspec.bench ...
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

from ..arguments import positive_int
from ..clocks import ClockSampler, gpu_id
from ..errors import OutputError
from ..output import check_output_file, make_output_dir
from . import specs, timing
from .anchors import deepgemm
from .card import Card, measure_copy_rate
from .cases import CASES, selected_cases
from .inputs import load_torch
from .plot import plot, plot_sweep
from .report import report
from .sweep import SWEEPS, run_sweep, sweep_report
from .timing import Result


def _output_file(example: str):
    """The type of an output file's option: the path as given; an empty one is refused."""

    def output_file(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected a path, got an empty string (a file name, such as {example})")
        return text

    return output_file


def _case_prefix(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a case's name or the start of one, got an empty string")
    return text


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gemmspec bench", description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", type=_case_prefix, default=None, metavar="CASE",
                    help="run only these cases (a name or the start of one: fp8_fwd, decode, ...; --list names them)")
    ap.add_argument("--repeat", type=positive_int, default=1, metavar="N",
                    help="do_bench runs per implementation (median of medians; default 1)")
    ap.add_argument("--json", metavar="FILE", type=_output_file("bench.json"),
                    help="write every measurement as JSON")
    ap.add_argument("--plot", metavar="FILE.png", type=_output_file("bench.png"),
                    help="draw gemmspec vs anchors per case (needs matplotlib)")
    ap.add_argument("--list", action="store_true", help="list the cases and their targets, then exit")
    ap.add_argument(
        "--sweep", choices=sorted(SWEEPS), metavar="NAME",
        help="instead of the table, time one shape over token counts: 'decode' is DeepSeek-V3's FP8 gate/up "
        "(256 experts top-8, N=4096, K=7168) at T = 1, 2, 4, ..., 4096 for gemmspec, torch and DeepGEMM (where "
        "importable), each point's time beside its HBM floor (bytes read / the copy rate: 4.2 TB/s on an H200, "
        "measured in the run on another card); --plot draws time "
        "against T, log-log, --json writes the points",
    )
    ap.add_argument("--no-deepgemm", action="store_true",
                    help="do not run DeepGEMM even where deep_gemm is importable (print its recorded figures, on an H200)")
    ap.add_argument("--tile", metavar="MxN", help="force this tile on every gemmspec launch (a tile directive)")
    ap.add_argument(
        "--idle", type=float, default=0.0, metavar="MS",
        help="let the GPU idle MS milliseconds before each timed launch (median of 60 launches "
        "instead of do_bench): sustained FP8 GEMMs throttle the card, so back-to-back rates "
        "depend on what ran before; with a pause every kernel starts from the same state",
    )
    # `gemmspec --traceback bench ...` passes it on: raise the errors bench reports itself.
    ap.add_argument("--traceback", action="store_true", help=argparse.SUPPRESS)
    return ap


def _tile(ap: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    """--tile MxN; the checker's rule for any spec (each spec may refuse more, and its row says so)."""
    try:
        m, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        ap.error(f"--tile expects MxN, e.g. 128x128, got {text!r}")
    if m not in (64, 128) or n % 8 or not 8 <= n <= 256:
        ap.error(f"--tile {text}: not a supported tile: the kernels take 64 or 128 rows by a multiple of 8 "
                 "columns from 8 to 256")
    return m, n


def _check_only(ap: argparse.ArgumentParser, only: list[str]) -> None:
    for prefix in only:
        if not selected_cases([prefix]):
            starts = ", ".join(sorted({c.name.split("_")[0] + "_" for c in CASES}))
            ap.error(f"--only {prefix!r} matches no case: case names start with {starts} "
                     "(`gemmspec bench --list` lists them)")


def _plot_formats() -> set[str] | None:
    """The file types matplotlib can save (None: matplotlib is not installed)."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


def plot_file(text: str) -> str:
    """The file a --plot name is saved to: matplotlib gives a name without a suffix (or
    ending in '.') its default type's, '.png', so the checks must look at that name."""
    if os.path.splitext(text)[1] in ("", "."):
        return text.rstrip(".") + ".png"
    return text


def _check_outputs(args: argparse.Namespace) -> None:
    """The --json and --plot files can be written (their folders made), and a plot drawn."""
    for option, text in (("--json", args.json), ("--plot", args.plot)):
        if text is not None:
            check_output_file(text, option)
    if args.plot is not None:
        written = plot_file(args.plot)
        if written != args.plot:  # the name matplotlib will write, checked as such
            check_output_file(written, "--plot")
            args.plot = written
    if args.json is not None and args.plot is not None and Path(args.json).resolve() == Path(args.plot).resolve():
        raise OutputError(f"--json and --plot name the same file, {args.plot}", args.plot)
    if args.plot is not None:
        formats = _plot_formats()
        if formats is None:
            raise OutputError(f"cannot write the --plot file {args.plot}: it needs matplotlib, which is not "
                              "installed (pip install matplotlib)", args.plot)
        suffix = Path(args.plot).suffix.lower().lstrip(".")
        if suffix and suffix not in formats:
            raise OutputError(f"cannot write the --plot file {args.plot}: matplotlib saves no '.{suffix}' files "
                              f"(it saves {', '.join(sorted(formats))})", args.plot)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    # Every option is checked before anything is set, the device looked for or any work done.
    if not math.isfinite(args.idle) or args.idle < 0:
        ap.error(f"--idle takes milliseconds >= 0, got {args.idle}")
    if args.sweep and (args.only is not None or args.list):
        ap.error("--sweep runs one shape over token counts: it takes no --only or --list")
    tile = _tile(ap, args.tile) if args.tile is not None else None
    if args.only is not None:
        _check_only(ap, args.only)
    try:
        _check_outputs(args)
    except OutputError as e:
        if args.traceback:
            raise
        print(f"gemmspec: error: {e}", file=sys.stderr)
        return 2
    # Set on every call (a later call from Python must not inherit an earlier one's).
    timing.IDLE_MS = args.idle
    specs.FORCED_TILE = tile
    if args.list:
        for c in selected_cases(args.only):
            print(f"{c.name:36} {c.target.describe():32} {c.what}")
        return 0
    # The device first: without one, say so at once rather than after importing torch.
    from ..errors import DeviceUnavailableError
    from ..runtime.arrays import require_hopper

    try:
        require_hopper(0)
    except DeviceUnavailableError as e:
        if args.traceback:
            raise
        print(f"gemmspec bench: error: {e}", file=sys.stderr)
        return 1
    try:
        torch = load_torch()
        import triton  # noqa: F401
    except ImportError as e:
        if args.traceback:
            raise
        print(f"gemmspec bench: needs torch and triton ({e})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gemmspec bench: torch sees no CUDA device (a CPU-only torch build?)", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    dg = deepgemm.DEEPGEMM = None if args.no_deepgemm else deepgemm.load()
    if dg is not None:
        print(f"DeepGEMM {deepgemm.version(dg)} found: timed beside gemmspec", file=sys.stderr)
    card = Card(torch.cuda.get_device_name(), measure_copy_rate(torch))
    if args.sweep:
        return _sweep(args, torch, props, dg, card)
    chosen = selected_cases(args.only)
    results: list[Result] = []
    failures: dict[str, str] = {}
    with ClockSampler(gpu_id(props)) as sampler:
        timing.SAMPLER = sampler
        for i, case in enumerate(chosen, 1):
            t0 = time.time()
            print(f"[{i}/{len(chosen)}] {case.name} ...", file=sys.stderr, flush=True)
            torch.manual_seed(i)
            try:
                results += case.measure(args.repeat)
            except Exception as e:  # noqa: BLE001 - a failing case is reported, the rest still run
                failures[case.name] = f"{type(e).__name__}: {e}"
            torch.cuda.empty_cache()
            print(f"      {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    timing.SAMPLER = None
    sms = props.multi_processor_count
    text, summary = report(results, failures, sms, card)
    print(f"GPU: {card.name} ({sms} SMs), torch {torch.__version__}; {card.describe()}")
    print(text)
    if any(r.sm_mhz is not None for r in results):
        print("clock, power: medians of nvidia-smi samples while each row was timed; * at the power cap")
    if args.json:
        make_output_dir(Path(args.json).parent, "--json file's directory")
        with open(args.json, "w") as f:
            version = deepgemm.version(dg) if dg is not None else None
            json.dump({"gpu": card.name, "torch": torch.__version__, "deepgemm": version,
                       "copy_rate_tbs": card.copy_rate_tbs, "measured_copy_rate_tbs": card.measured_tbs,
                       "cases": summary}, f, indent=1)
    if args.plot:
        make_output_dir(Path(args.plot).parent, "--plot file's directory")
        plot(summary, args.plot)
    return 1 if failures else 0


def _sweep(args, torch, props, dg, card: Card) -> int:
    """`--sweep NAME`: the sweep's points timed, its table printed, written and drawn."""
    sweep = SWEEPS[args.sweep]
    with ClockSampler(gpu_id(props)) as sampler:
        timing.SAMPLER = sampler
        results, failures = run_sweep(sweep, args.repeat)
    timing.SAMPLER = None
    text, summary = sweep_report(sweep, results, failures, card)
    print(f"GPU: {card.name} ({props.multi_processor_count} SMs), torch {torch.__version__}; {card.describe()}")
    print(text)
    if args.json:
        make_output_dir(Path(args.json).parent, "--json file's directory")
        with open(args.json, "w") as f:
            version = deepgemm.version(dg) if dg is not None else None
            json.dump({"gpu": card.name, "torch": torch.__version__, "deepgemm": version,
                       "measured_copy_rate_tbs": card.measured_tbs} | summary, f, indent=1)
    if args.plot:
        make_output_dir(Path(args.plot).parent, "--plot file's directory")
        plot_sweep(summary, args.plot)
    return 1 if failures else 0
