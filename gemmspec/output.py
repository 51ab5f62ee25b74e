"""What gemmspec writes to disk: the files `gemmspec compile` writes for other builds,
the numbered stage outputs of `--dump-ir`, and the helpers that write them.

Every file of every spec is made in memory first (cubins included), and the names
are checked to stay distinct on case-insensitive file systems, before the first
byte is written: an error in any spec leaves the output folder as it was.

This module sits above the compiler: it reads the front half's values (pipeline),
the emitted programs (codegen), the explain JSON and, for cubins, NVRTC (runtime).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import ast
from .codegen.emit import EmittedProgram
from .codegen.host import render_header, render_host
from .codegen.kernels import include_dir
from .codegen.manifest import SHARED_HEADER, Manifest, launch_manifest, with_decode_choice
from .codegen.names import MAX_FILE_NAME_BYTES, file_stem, header_guard
from .codegen.variants import decode_variant
from .errors import OutputError
from .explain import schedule_json
from .lower.schedule import Schedule
from .pipeline import Lowered, load, lower_file
from .spec import Spec

__all__ = [
    "MAX_FILE_NAME_BYTES",
    "SHARED_HEADER",
    "SpecFiles",
    "check_file_names",
    "check_output_dir",
    "check_output_file",
    "check_symbols",
    "dump_front_half",
    "file_stem",
    "header_guard",
    "lower_and_dump",
    "make_output_dir",
    "output_dir_problem",
    "plan_programs",
    "spec_files",
    "write_if_changed",
    "write_programs",
    "write_program",
]


# ---------------------------------------------------------------------------- writing
def write_if_changed(path: Path, content: str | bytes) -> None:
    """Leave files whose content is already right untouched (keeps build tools quiet).

    A changed file is replaced in one rename, so a failed write never leaves half a
    file behind; any failure comes back as an OutputError naming the path.
    """
    data = content.encode("utf-8") if isinstance(content, str) else content
    try:
        if path.is_dir():
            raise OutputError(f"cannot write {path}: a directory is in the way", str(path))
        if path.is_file() and path.read_bytes() == data:
            return
        _replace(path, data)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {_reason(e)}", str(path)) from e


def _replace(path: Path, data: bytes) -> None:
    # Mode 0o666 lets the umask decide, as for any file a build tool writes.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def output_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be a folder to write into, judged without creating anything."""
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            return "it exists and is not a directory"
        existing = path
    else:
        existing = next((p for p in path.parents if p.exists()), Path("."))
        if not existing.is_dir():
            return f"{existing} exists and is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def check_output_dir(path: Path, what: str) -> None:
    """Raise an OutputError now, before any work, if `path` cannot hold output files."""
    problem = output_dir_problem(path)
    if problem is not None:
        raise OutputError(f"cannot write the {what} {path}: {problem}", str(path))


def check_output_file(path: str | Path, option: str) -> None:
    """Raise an OutputError now, before any work, if `path` cannot be written as a file.

    `path` as the user typed it (a Path would drop a trailing '/'); `option` names it.
    """
    text = str(path)
    target = Path(text)
    if target.is_dir():
        raise OutputError(f"cannot write the {option} file {text}: it is a directory", text)
    # Not there yet, but named as a folder: writing it would fail only after the work.
    if text.endswith(("/", os.sep)):
        raise OutputError(f"cannot write the {option} file {text}: it ends in '/', a directory's name", text)
    # Its mode says no: open() would fail only after the work, and the rename of
    # write_if_changed would pass over it.
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputError(f"cannot write the {option} file {text}: it is not writable", text)
    check_output_dir(target.parent, f"{option} file's directory")


def make_output_dir(path: Path, what: str) -> None:
    """Create `path` and its parents, or raise an OutputError saying what is in the way."""
    check_output_dir(path, what)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the {what} {path}: {_reason(e)}", str(path)) from e


# ---------------------------------------------------------------------------- --dump-ir
def lower_and_dump(source: str | Path | ast.FileAst, dump_dir: str | Path | None = None) -> list[Lowered]:
    """Check, analyse and lower every spec of a file (pipeline.lower_file); with
    `dump_dir`, each stage's output is written to a numbered file there."""
    file = load(source)
    out = lower_file(file)
    if dump_dir is not None:
        dump_front_half(file, out, Path(dump_dir))
    return out


def dump_front_half(file: ast.FileAst, lowered: list[Lowered], where: Path) -> None:
    make_output_dir(where, "--dump-ir directory")
    write_if_changed(where / "01-ast.txt", "\n\n".join(_ast_text(s) for s in file.specs) + "\n")
    write_if_changed(where / "02-spec.txt", "\n\n".join(str(x.spec) for x in lowered) + "\n")
    write_if_changed(where / "03-decision.txt", "\n\n".join(str(x.decision) for x in lowered) + "\n")
    write_if_changed(where / "04-schedule.txt", "\n\n".join(str(x.schedule) for x in lowered) + "\n")
    doc = [schedule_json(x.spec, x.schedule) for x in lowered]
    write_if_changed(where / "04-schedule.json", json.dumps(doc, indent=2) + "\n")


def _ast_text(s: ast.SpecAst) -> str:
    lines = [f"gemm {s.name} @ {s.name.pos}"]
    lines += [f"  {d}" for d in s.dims]
    lines += [f"  {g}" for g in s.groups]
    lines += [f"  {t}" for t in s.tensors]
    lines += [f"  {st}" for st in s.statements]
    lines += [f"  {d}" for d in s.directives]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- compile


@dataclass(frozen=True)
class SpecFiles:
    """What `compile` writes for one spec: file name -> content, nothing written yet."""

    spec: Spec
    files: dict[str, bytes]
    manifest: Manifest


def spec_files(
    spec: Spec, schedule: Schedule, program: EmittedProgram, cubins: bool = False, source: str | None = None,
    names_only: bool = False,
) -> SpecFiles:
    """Every file of one spec: per kernel a .cu (and a .cubin), the host launcher, the
    .h, the launch manifest and the schedule, all from the manifest's data; with
    `source`, the spec's .gspec text too (a derived backward's, `<stem>.gspec`);
    `names_only`: the cubins named but not compiled (empty: `compile --list`). Where
    launches have a decode variant (codegen/variants.py), its changed launches' files
    too, as `<stem>_launch<i>_decode.cu`, and the launcher picks per call."""
    stem = file_stem(spec.name)
    manifest = launch_manifest(spec, program, stem)
    variant = decode_variant(spec, schedule, program)
    if variant is not None:
        manifest = with_decode_choice(spec, manifest, variant)
    files: dict[str, bytes] = {}
    if source is not None:
        files[f"{stem}.gspec"] = source.encode("utf-8")
    sources = []
    for fname, text in program.sources().items():
        if fname.startswith(program.spec):
            fname = stem + fname[len(program.spec) :]
        sources.append((fname, text))
    if variant is not None:
        assert manifest.decode is not None
        decode_sources = variant.program.sources()
        sources += [(out, decode_sources[fname]) for out, fname in sorted(manifest.decode.files.items())]
    for fname, text in sources:
        files[fname] = text.encode("utf-8")
        if cubins and names_only:
            files[f"{Path(fname).stem}.cubin"] = b""
        elif cubins:
            from .runtime.nvrtc import compile_cubin

            kernel = Path(fname).stem
            compiled = compile_cubin(text, name=kernel, include_dirs=[include_dir()])
            files[f"{kernel}.cubin"] = compiled.cubin
    files[f"{stem}_host.cu"] = render_host(manifest).encode("utf-8")
    files[f"{stem}.h"] = render_header(manifest).encode("utf-8")
    files[f"{stem}.manifest.json"] = manifest.dumps().encode("utf-8")
    doc = json.dumps(schedule_json(spec, schedule, program), indent=2) + "\n"
    files[f"{stem}.schedule.json"] = doc.encode("utf-8")
    return SpecFiles(spec, files, manifest)


def check_symbols(planned: Sequence[SpecFiles]) -> None:
    """Refuse two specs that would define one extern "C" symbol (they could not link)."""
    owners: dict[str, Spec] = {}
    for sf in planned:
        m = sf.manifest
        symbols = [k.symbol for k in m.all_kernels]
        symbols += [f"{m.prefix}_run", f"{m.prefix}_workspace_bytes"]
        for symbol in symbols:
            other = owners.setdefault(symbol, sf.spec)
            if other is not sf.spec:
                raise OutputError(
                    f"specs '{other.name}' ({other.path}:{other.line}) and '{sf.spec.name}' "
                    f"({sf.spec.path}:{sf.spec.line}) would both define {symbol}; rename one of the specs"
                )


def check_file_names(planned: Sequence[SpecFiles]) -> None:
    """Refuse file names that clash on a case-insensitive file system, or are too long."""
    owners: dict[str, tuple[str, Spec | None]] = {SHARED_HEADER.casefold(): (SHARED_HEADER, None)}
    for sf in planned:
        for name in sf.files:
            if len(name.encode("utf-8")) > MAX_FILE_NAME_BYTES:
                raise OutputError(
                    f"spec '{sf.spec.name}' would write a file name longer than "
                    f"{MAX_FILE_NAME_BYTES} bytes: {name}"
                )
            folded = name.casefold()
            if folded in owners:
                other_name, other = owners[folded]
                raise OutputError(_clash(sf.spec, name, other, other_name))
            owners[folded] = (name, sf.spec)


def _clash(spec: Spec, name: str, other: Spec | None, other_name: str) -> str:
    where = f"{spec.path}:{spec.line}"
    if other is None:
        return (
            f"spec '{spec.name}' ({where}) would write {name}, which is gemmspec's own "
            f"{other_name} on a case-insensitive file system; rename the spec"
        )
    return (
        f"specs '{other.name}' ({other.path}:{other.line}) and '{spec.name}' ({where}) would write "
        f"files whose names differ only in case ({other_name}, {name}), which collide on "
        "case-insensitive file systems; rename one of the specs"
    )


def plan_programs(
    programs: Sequence[tuple[Spec, Schedule, EmittedProgram]], cubins: bool = False,
    sources: Mapping[str, str] | None = None, names_only: bool = False,
) -> list[SpecFiles]:
    """Every spec's files in memory, their names and symbols checked; nothing written.
    `sources` (spec name -> .gspec text) adds a spec's text to its files: the derived
    backward specs of `compile --backward`, which exist nowhere else. `names_only`: the
    cubins are named, not compiled (their contents empty), for a listing."""
    sources = sources or {}
    planned = [
        spec_files(spec, schedule, program, cubins, sources.get(spec.name), names_only)
        for spec, schedule, program in programs
    ]
    check_file_names(planned)
    check_symbols(planned)
    return planned


def write_programs(
    programs: Sequence[tuple[Spec, Schedule, EmittedProgram]], out: Path, cubins: bool = False,
    sources: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write every spec's files and the shared PTX header into `out`; returns the paths.
    `sources` as for `plan_programs`."""
    planned = plan_programs(programs, cubins, sources)
    for name in [SHARED_HEADER, *(n for sf in planned for n in sf.files)]:
        if (out / name).is_dir():
            raise OutputError(f"cannot write {out / name}: a directory is in the way", str(out / name))
    make_output_dir(out, "output directory")
    shared = out / SHARED_HEADER
    write_if_changed(shared, (Path(include_dir()) / SHARED_HEADER).read_bytes())
    written = [shared]
    for sf in planned:
        for name, content in sf.files.items():
            write_if_changed(out / name, content)
            written.append(out / name)
    return written


def write_program(
    spec: Spec, schedule: Schedule, program: EmittedProgram, out: Path, cubins: bool = False
) -> list[Path]:
    """`write_programs` for one spec."""
    return write_programs([(spec, schedule, program)], out, cubins)
