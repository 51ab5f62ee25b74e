"""Write emitted programs out as standalone files for other builds.

Every file of every spec is made in memory first (cubins included), and the names
are checked to stay distinct on case-insensitive file systems, before the first
byte is written: an error in any spec leaves the output folder as it was.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError
from ..explain import schedule_json
from ..lower.schedule import Schedule
from ..spec import Spec
from .emit import EmittedProgram
from .host import render_header, render_host
from .kernels import include_dir
from .manifest import SHARED_HEADER, Manifest, launch_manifest
from .names import MAX_FILE_NAME_BYTES, file_stem, header_guard

__all__ = [
    "MAX_FILE_NAME_BYTES",
    "SHARED_HEADER",
    "SpecFiles",
    "check_file_names",
    "check_symbols",
    "file_stem",
    "header_guard",
    "plan_programs",
    "spec_files",
    "write_programs",
    "write_program",
]


@dataclass(frozen=True)
class SpecFiles:
    """What `compile` writes for one spec: file name -> content, nothing written yet."""

    spec: Spec
    files: dict[str, bytes]
    manifest: Manifest


def spec_files(
    spec: Spec, schedule: Schedule, program: EmittedProgram, cubins: bool = False
) -> SpecFiles:
    """Every file of one spec: per kernel a .cu (and a .cubin), the host launcher, the
    .h, the launch manifest and the schedule, all from the manifest's data."""
    stem = file_stem(spec.name)
    manifest = launch_manifest(spec, program, stem)
    files: dict[str, bytes] = {}
    for fname, source in program.sources().items():
        if fname.startswith(program.spec):
            fname = stem + fname[len(program.spec) :]
        files[fname] = source.encode("utf-8")
        if cubins:
            from ..runtime.nvrtc import compile_cubin

            kernel = Path(fname).stem
            compiled = compile_cubin(source, name=kernel, include_dirs=[include_dir()])
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
        symbols = [k.symbol for k in m.kernels]
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
    programs: Sequence[tuple[Spec, Schedule, EmittedProgram]], cubins: bool = False
) -> list[SpecFiles]:
    """Every spec's files in memory, their names and symbols checked; nothing written."""
    planned = [spec_files(spec, schedule, program, cubins) for spec, schedule, program in programs]
    check_file_names(planned)
    check_symbols(planned)
    return planned


def write_programs(
    programs: Sequence[tuple[Spec, Schedule, EmittedProgram]], out: Path, cubins: bool = False
) -> list[Path]:
    """Write every spec's files and the shared PTX header into `out`; returns the paths."""
    from ..pipeline import make_output_dir, write_if_changed

    planned = plan_programs(programs, cubins)
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
