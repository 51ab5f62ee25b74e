"""The `gemmspec` command line.

Errors in specs print as `FILE:LINE:COL: error: ...` with the source line and a
caret, and the command exits with status 1; usage and file errors (a missing input,
an output folder that cannot be written) print `gemmspec: error: ...` and exit with
status 2. No Python traceback reaches a user unless `--traceback` asks for it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from .arguments import digits, positive_int
from .errors import DeviceUnavailableError, GemmspecError, OutputError

EXIT_SPEC_ERROR = 1
EXIT_USAGE = 2
EXPLAIN_WIDTH = 100  # the most columns `explain` wraps its text at on a terminal


class _SpecFile(argparse.Action):
    """FILE as a Path, and as typed in `file_text`: the specs name their file as the user
    wrote it (a Path would shorten `./m.gspec` to `m.gspec`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.file_text = str(values)
        setattr(namespace, self.dest, Path(values))


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", action=_SpecFile, help="a .gspec file")
    p.add_argument(
        "--dump-ir",
        metavar="DIR",
        type=_output_path,
        help="write every stage's output (AST, checked spec, decision, schedule, ...) to DIR",
    )


def version() -> str:
    """The installed distribution's version; the package's own `__version__` where gemmspec
    runs from a source tree that was never installed (PYTHONPATH=.)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("gemmspec")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gemmspec",
        description=(
            "Compile declarative grouped-GEMM specs (nested groups, FP8 scaling granularity, "
            "layouts) to CUDA for NVIDIA Hopper (sm_90a)."
        ),
        epilog="See docs/language.md for the .gspec language and docs/usage.md for every command.",
    )
    parser.add_argument("--version", action="version", version=f"gemmspec {version()}")
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="on an error, raise it with its Python traceback instead of printing a message",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "check",
        help="parse and check a spec; report the first error with its location",
        description="Parse and check FILE. Prints 'ok' per spec, or a located error and exits 1.",
    )
    _add_common(p)
    p.set_defaults(run=cmd_check)

    p = sub.add_parser(
        "explain",
        help="show the nest, the flatten/split decision with reasons, launches and pre-passes",
        description=(
            "Explain how FILE is lowered: the nest of groups, whether it flattens into one "
            "launch or splits (with every reason), each launch's kernel signature and flat "
            "problem formulas, and any requantization/transpose pre-passes. With --backward, "
            "the derived backward spec instead: what was derived (and what not, and why), its "
            ".gspec text and its explain. --json carries the backward under each spec's "
            "'backward' key."
        ),
    )
    _add_common(p)
    form = p.add_mutually_exclusive_group()  # the JSON carries the backward under 'backward'
    form.add_argument("--json", action="store_true", help="print the documented JSON form instead")
    form.add_argument(
        "--backward",
        action="store_true",
        help="explain the derived backward (DGRAD/WGRAD) spec: its text and its explain",
    )
    p.add_argument(
        "--width",
        type=_width,
        metavar="N",
        help=(
            f"wrap the text at N columns; 0: one line per item. Default: the terminal's width, at "
            f"most {EXPLAIN_WIDTH}, on a terminal; one line per item into a pipe or file (for grep)"
        ),
    )
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser(
        "compile",
        help="emit CUDA: .cu files, a .h of their entry points and the schedule JSON",
        description=(
            "Compile FILE to standalone CUDA in DIR: one .cu per launch and pre-pass "
            "(and <spec>_launch<i>_decode.cu for a launch over ragged rows of a run-time dim: "
            "its decode variant, which the host launcher picks per call for small sizes), "
            "gemmspec_ptx.cuh, <spec>_host.cu (the host launcher gemmspec_<spec>_run), <spec>.h, "
            "<spec>.manifest.json and <spec>.schedule.json. Each .cu builds with "
            "nvcc -gencode=arch=compute_90a,code=sm_90a -c."
        ),
    )
    _add_common(p)
    p.add_argument("-o", "--output", metavar="DIR", type=_output_path, default=Path("out"), help="output directory (default: out)")
    p.add_argument("--cubin", action="store_true", help="also compile each .cu to an sm_90a cubin with NVRTC")
    p.add_argument(
        "--backward",
        action="store_true",
        help="also derive each spec's backward and write its text (<spec>_backward.gspec) and compiled files",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print the paths compile would write, one per line, and write nothing (for build systems)",
    )
    p.set_defaults(run=cmd_compile)

    p = sub.add_parser(
        "run",
        help="on a Hopper GPU: run on random data, compare with the float64 reference, time it",
        description=(
            "Build FILE, make random inputs quantized with the spec's scales, run the schedule on "
            "the GPU, compare every output with the float64 reference of the dequantized inputs "
            "and print the error and the time."
        ),
    )
    _add_common(p)
    p.add_argument("--dims", nargs="*", type=_dim_item, default=[], metavar="NAME=SIZE", help="run-time dim sizes, e.g. T=32768")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--repeats", type=positive_int, default=10, metavar="R", help="timed runs, median reported (default 10)")
    p.set_defaults(run=cmd_run)

    p = sub.add_parser(
        "tune",
        help="on a Hopper GPU: time the spec's tile choices and say which tile(M, N) to write",
        description=(
            "Time FILE's tile choices on the GPU: the spec as written, then the spec with each "
            "tile(M, N) directive the checker accepts (M 64 or 128, N among the widths the tile "
            "heuristic considers). Every candidate is built, run once on the same random inputs "
            "and compared with the float64 reference (as `gemmspec run` does); one that fails is "
            "reported FAILED and not timed. The others are timed by CUDA events, the L2 flushed "
            "before each call. Prints a table, the fastest candidate and the line to add to the "
            "spec, or says to keep the spec as written when it is within 1% of the fastest."
        ),
        epilog=(
            "Exit status: 0 when every candidate built and matched the reference, 1 when one "
            "failed (or on a spec error or without a GPU), 2 on a usage or file error. "
            "Nothing is cached: the suggestion only counts once written into the spec."
        ),
    )
    _add_common(p)
    p.add_argument("--dims", nargs="*", type=_dim_item, default=[], metavar="NAME=SIZE", help="run-time dim sizes, e.g. T=32768")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and segment lengths (default 0)")
    p.add_argument(
        "--repeat", type=positive_int, default=20, metavar="N", help="timed calls per candidate; the median counts (default 20)"
    )
    p.add_argument("--json", metavar="OUT", type=_output_file, help="also write the report as JSON to OUT")
    p.add_argument(
        "--only",
        nargs="+",
        type=_tile_arg,
        metavar="M,N",
        help="try only these tiles (beside the spec as written), e.g. --only 128,160 64,192",
    )
    p.set_defaults(run=cmd_tune)

    p = sub.add_parser(
        "bench",
        help="on a Hopper GPU: time gemmspec beside PyTorch's grouped GEMMs (needs torch)",
        description="Run the benchmark table; `gemmspec bench --help` lists its options.",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="options of the benchmark (see --help)")
    p.set_defaults(run=cmd_bench)
    return parser


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    # The benchmark reports its own errors; `--traceback` asks it to raise them instead.
    return bench_main(["--traceback", *args.args] if args.traceback else args.args)


def _lower(args: argparse.Namespace):
    """Every spec of FILE lowered (and dumped where --dump-ir asks), each naming FILE as typed."""
    from .output import lower_and_dump
    from .parse import parse_file

    return lower_and_dump(parse_file(args.file_text), args.dump_ir)


def _check_output_dirs(args: argparse.Namespace) -> None:
    """Fail on an unusable output folder before any work, so nothing is half-written."""
    from .output import check_output_dir

    if args.dump_ir is not None:
        check_output_dir(args.dump_ir, "--dump-ir directory")
    if getattr(args, "output", None) is not None:
        check_output_dir(args.output, "output directory")


def cmd_compile(args: argparse.Namespace) -> int:
    from .codegen.emit import emit
    from .output import SHARED_HEADER, plan_programs, write_programs

    _check_output_dirs(args)
    lowered = _lower(args)
    sources: dict[str, str] = {}
    if args.backward:
        backwards = [_backward_of(x.spec) for x in lowered]
        for bw, _ in backwards:
            _note_not_derived(bw)
            sources[bw.spec_name] = bw.source
        lowered = [*lowered, *(x for _, x in backwards)]
    programs = [(x.spec, x.schedule, emit(x.spec, x.schedule)) for x in lowered]
    if args.list:
        # The names only: no cubin is compiled to be listed (a build system's query).
        planned = plan_programs(programs, args.cubin, sources, names_only=True)
        names = [SHARED_HEADER, *(n for sf in planned for n in sf.files)]
        for name in names:
            print(args.output / name)
        return 0
    for path in write_programs(programs, args.output, cubins=args.cubin, sources=sources):
        print(path)
    return 0


def _backward_of(spec):
    """The derived backward of `spec` and its lowered form; an error with every reason
    when no statement derives."""
    from .pipeline import lower_backward

    bw, lowered = lower_backward(spec)
    if lowered is None:
        why = "; ".join(f"statement #{s.forward}: {s.reason}" for s in bw.skipped) or "no statement"
        raise GemmspecError(f"{spec.path}: {spec.name}: no backward derived ({why})")
    return bw, lowered


def _note_not_derived(bw) -> None:
    """What a backward leaves out, on stderr (the spec is written all the same)."""
    for s in bw.skipped:
        print(f"gemmspec: note: {bw.spec_name}: statement #{s.forward} not derived: {s.reason}", file=sys.stderr)
    for name, why in bw.not_derived:
        print(f"gemmspec: note: {bw.spec_name}: gradient of '{name}' not derived: {why}", file=sys.stderr)


def _output_path(text: str) -> Path:
    """An output path as given. An empty one is refused: Path("") is the current
    directory, which would fill it with whatever the command writes."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string (write '.' for the current directory)")
    return Path(text)


def _output_file(text: str) -> str:
    """An output file's path as typed (a Path would drop a trailing '/', which names a
    folder); an empty one is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string (a file name, such as tune.json)")
    return text


def _width(text: str) -> int:
    if not digits(text) or not (int(text) == 0 or int(text) >= 40):
        raise argparse.ArgumentTypeError(f"expected 0 (no wrapping) or a width of at least 40, got {text!r}")
    return int(text)


def _tile_arg(text: str) -> tuple[int, int]:
    m, sep, n = text.partition(",")
    if not sep or not digits(m.strip()) or not digits(n.strip()):
        raise argparse.ArgumentTypeError(f"expected M,N (a tile such as 128,160), got {text!r}")
    return int(m), int(n)


def _seed_ok(seed: int) -> bool:
    """Whether --seed can seed numpy's generators, which take no negative seed (else say why)."""
    if seed < 0:
        print(f"gemmspec: error: --seed: expected a seed of 0 or more, got {seed}", file=sys.stderr)
        return False
    return True


def _dim_item(text: str) -> str:
    """One --dims item as given (`_dims` reads it). `--dims T=4 spec.gspec` takes the
    spec's path as an item, and argparse would then say only that FILE is missing: such
    an item is refused here, where argparse can say so."""
    if "=" not in text and (text.endswith(".gspec") or Path(text).is_file()):
        raise argparse.ArgumentTypeError(f"expected NAME=SIZE, got {text!r} (FILE goes before --dims)")
    return text


def _dims(items: list[str]) -> dict[str, int] | None:
    """--dims NAME=SIZE ...; None (after saying why) when one is malformed. Whether each
    names a run-time dim of the spec, in range, is `_check_dims`'s to say."""
    dims: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name:
            print(f"gemmspec: error: --dims expects NAME=SIZE, got {item!r}", file=sys.stderr)
            return None
        # ASCII digits only: str.isdigit() also takes superscripts, which int() refuses.
        if re.fullmatch(r"[+-]?[0-9]+", value) is None:
            print(f"gemmspec: error: --dims {name}: expected an integer size, got {value!r}", file=sys.stderr)
            return None
        if name in dims:
            print(f"gemmspec: error: --dims gives '{name}' twice", file=sys.stderr)
            return None
        dims[name] = int(value)
    return dims


def _check_dims(spec, dims: dict[str, int]) -> bool:
    """Whether `dims` fit the spec's run-time dims (else say why); before any device work."""
    from .errors import ArgumentError
    from .reference.data import check_run_dims

    try:
        check_run_dims(spec, dims)
    except ArgumentError as e:
        print(f"gemmspec: error: --dims: {e}", file=sys.stderr)
        return False
    return True


def cmd_tune(args: argparse.Namespace) -> int:
    from .output import check_output_file
    from .tune import tune

    dims = _dims(args.dims)
    if dims is None or not _seed_ok(args.seed):
        return EXIT_USAGE
    _check_output_dirs(args)
    json_path = None if args.json is None else Path(args.json)
    if json_path is not None:
        # The report would replace the spec: said first, even of a spec that is read-only.
        if not json_path.is_dir() and json_path.resolve() == args.file.resolve():
            raise OutputError(f"cannot write the --json file {args.json}: it is the spec file", args.json)
        check_output_file(args.json, "--json")
    lowered = _lower(args)
    if len(lowered) == 1 and not _check_dims(lowered[0].spec, dims):  # several: tune says so
        return EXIT_USAGE

    def on_candidates(found) -> None:
        print(f"{found.spec}: {len(found.candidates)} candidate(s), {len(found.skipped)} skipped", file=sys.stderr)

    report = tune(
        args.file, dims=dims, seed=args.seed, repeat=args.repeat, only=args.only,
        progress=lambda line: print(line, file=sys.stderr, flush=True), on_candidates=on_candidates,
    )
    print(report.text())
    if json_path is not None:
        from .output import make_output_dir, write_if_changed

        make_output_dir(json_path.parent, "--json file's directory")
        write_if_changed(json_path, json.dumps(report.to_json(), indent=2) + "\n")
    return 0 if report.ok else EXIT_SPEC_ERROR


def cmd_run(args: argparse.Namespace) -> int:
    from .build import build
    from .runtime.arrays import require_hopper
    from .runtime.verify import run_random

    dims = _dims(args.dims)
    if dims is None or not _seed_ok(args.seed):
        return EXIT_USAGE
    _check_output_dirs(args)
    lowered = _lower(args)
    if len(lowered) > 1:
        names = ", ".join(x.spec.name for x in lowered)
        raise GemmspecError(f"{args.file}: run takes a file with one spec; it defines {len(lowered)} ({names})")
    exe = build(args.file)
    if not _check_dims(exe.spec, dims):
        return EXIT_USAGE
    require_hopper(0)  # before the seconds of random inputs and reference on the host
    report = run_random(exe, dims=dims, seed=args.seed, repeats=args.repeats)
    for c in report.checks:
        print(f"{report.spec}: {c.describe()}")
    print(f"{report.spec}: dims {report.dims}: {report.seconds * 1e3:.3f} ms, {report.tflops:.1f} TFLOPS")
    if exe.decode is not None:  # which of the two programs this size ran (see explain)
        picked = exe.program_for(report.dims) is exe.decode.program
        print(f"{report.spec}: {'the decode variant' if picked else 'the kernels as compiled'} "
              f"(the decode variant when {exe.decode.rule.describe()})")
    return 0 if report.ok else EXIT_SPEC_ERROR


def cmd_check(args: argparse.Namespace) -> int:
    _check_output_dirs(args)
    for x in _lower(args):
        print(f"{args.file_text}: {x.spec.name}: ok ({len(x.spec.gemms)} statement(s))")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .explain import backward_json, explain_text, schedule_json

    _check_output_dirs(args)
    lowered = _lower(args)
    if args.json:
        docs = [{**schedule_json(x.spec, x.schedule), "backward": backward_json(x.spec)} for x in lowered]
        print(json.dumps(docs, indent=2))
        return 0
    width = args.width
    if width is None:  # wrap for a reader, not for a program reading the lines
        width = max(40, min(EXPLAIN_WIDTH, shutil.get_terminal_size().columns)) if sys.stdout.isatty() else 0
    width = width or None
    if args.backward:
        parts = []
        for x in lowered:
            bw, b = _backward_of(x.spec)
            text = explain_text(b.spec, b.schedule, backward=False, width=width)
            parts.append("\n".join([bw.text(), "", bw.source.rstrip("\n"), "", text]))
        print("\n\n".join(parts))
    else:
        print("\n\n".join(explain_text(x.spec, x.schedule, width=width) for x in lowered))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = argv[:1] == ["--traceback"]
    rest = argv[1:] if show_traceback else argv
    if rest[:1] == ["bench"]:  # the benchmark parses its own options
        args = argparse.Namespace(args=rest[1:], run=cmd_bench, traceback=show_traceback)
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # `gemmspec explain ... | head`
        sys.stderr.close()
        return 0
    except (GemmspecError, OSError, UnicodeDecodeError) as e:
        if args.traceback:
            raise
        status, message = _report(e, args)
        print(message, file=sys.stderr)
        return status


def _report(e: Exception, args: argparse.Namespace) -> tuple[int, str]:
    """Exit status and message for an error that ends a command."""
    spec_file = getattr(args, "file", None)
    if isinstance(e, OutputError):
        return EXIT_USAGE, f"gemmspec: error: {e}"
    if isinstance(e, DeviceUnavailableError):
        return EXIT_SPEC_ERROR, f"gemmspec: error: {e}"
    if isinstance(e, GemmspecError):
        return EXIT_SPEC_ERROR, str(e)
    if not isinstance(e, OSError):  # a UnicodeDecodeError: only the spec file is read as text
        return EXIT_USAGE, f"gemmspec: error: {spec_file} is not UTF-8 text"
    if e.filename is None:
        if e.errno is None:  # not a system call's error (a library that would not load)
            return EXIT_USAGE, f"gemmspec: error: {e}"
        # No file named: writing the standard output failed (a full disk, a closed stream).
        return EXIT_USAGE, f"gemmspec: error: cannot write the output: {e.strerror or e}"
    path = e.filename
    if isinstance(e, FileNotFoundError) and spec_file is not None and str(path) == str(spec_file):
        return EXIT_USAGE, f"gemmspec: error: cannot read {path}: no such file"
    if isinstance(e, IsADirectoryError) and spec_file is not None and str(path) == str(spec_file):
        return EXIT_USAGE, f"gemmspec: error: {path} is a directory, not a .gspec file"
    return EXIT_USAGE, f"gemmspec: error: {path}: {e.strerror or e}"


if __name__ == "__main__":
    sys.exit(main())
