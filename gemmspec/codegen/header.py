"""Write an emitted program out as standalone files for other builds."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from ..explain import schedule_json
from ..lower.schedule import Schedule
from ..spec import Spec
from .emit import EmittedProgram
from .kernels import include_dir

_ENTRY = re.compile(
    r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(?:__cluster_dims__\([^)]*\)\s*)?'
    r"(\w+)\(([^)]*)\)"
)


def entry_points(source: str) -> list[str]:
    """`extern "C"` kernel declarations found in emitted source."""
    return [
        f'extern "C" __global__ void {name}({" ".join(params.split())});'
        for name, params in _ENTRY.findall(source)
    ]


def write_program(spec: Spec, schedule: Schedule, program: EmittedProgram, out: Path, cubins: bool = False) -> list[Path]:
    from ..pipeline import write_if_changed

    out.mkdir(parents=True, exist_ok=True)
    written = []
    header = out / "gemmspec_ptx.cuh"
    shutil.copyfile(Path(include_dir()) / "gemmspec_ptx.cuh", header)
    written.append(header)
    decls = []
    for fname, source in program.sources().items():
        path = out / fname
        write_if_changed(path, source)
        written.append(path)
        decls += entry_points(source)
        if cubins:
            from ..runtime.nvrtc import compile_cubin

            compiled = compile_cubin(source, name=path.stem, include_dirs=[include_dir()])
            cubin = path.with_suffix(".cubin")
            cubin.write_bytes(compiled.cubin)
            written.append(cubin)
    guard = f"GEMMSPEC_{spec.name.upper()}_H"
    h = out / f"{spec.name}.h"
    text = "\n".join(
        [
            f"// Entry points emitted by gemmspec for spec '{spec.name}'. Launch order and",
            f"// arguments: {spec.name}.schedule.json and docs/kernel-abi.md.",
            f"#ifndef {guard}",
            f"#define {guard}",
            '#include "gemmspec_ptx.cuh"',
            *sorted(set(decls)),
            f"#endif  // {guard}",
            "",
        ]
    )
    write_if_changed(h, text)
    written.append(h)
    js = out / f"{spec.name}.schedule.json"
    write_if_changed(js, json.dumps(schedule_json(spec, schedule), indent=2) + "\n")
    written.append(js)
    return written
