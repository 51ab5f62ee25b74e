"""Compile the kernels two emitted trees disagree on and compare their SASS.

    python scripts/emit_hashes.py --dump /tmp/before > /tmp/before.txt   # on the old revision
    python scripts/emit_hashes.py --dump /tmp/after > /tmp/after.txt     # on the new one
    python scripts/sass_diff.py /tmp/before /tmp/after

A change to the templates that should move no instruction (a helper factored out, a
comment) changes the kernels' sources, so their hashes differ; what matters is whether
the SASS does. Every kernel `.cu` present in both trees whose bytes differ is compiled by
NVRTC for sm_90a (each tree with its own `gemmspec_ptx.cuh`), disassembled, and compared
line by line. Prints one line per such kernel, then a summary; exits 1 where any SASS
differs (with the opcodes whose counts moved), 0 where none does.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def _kernels(tree: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(tree)): p
        for p in sorted(tree.rglob("*.cu"))
        if not p.name.endswith("_host.cu")
    }


def _header_dir(path: Path) -> Path:
    """The nearest folder above `path` with the device header (a backward spec's folder
    lies inside its forward's, which holds the header)."""
    for folder in path.parents:
        if (folder / "gemmspec_ptx.cuh").is_file():
            return folder
    raise SystemExit(f"no gemmspec_ptx.cuh above {path}")


def _sass(path: Path) -> str:
    from gemmspec.runtime import nvrtc

    compiled = nvrtc.compile_cubin(path.read_text(), name=path.stem, include_dirs=[str(_header_dir(path))])
    return nvrtc.disassemble(compiled.cubin)


def _opcodes(sass: str) -> Counter:
    return Counter(m.group(1) for m in _OPCODE.finditer(sass))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path, help="a tree written by emit_hashes.py --dump")
    ap.add_argument("after", type=Path, help="another one")
    args = ap.parse_args()
    before, after = _kernels(args.before), _kernels(args.after)
    changed = [k for k in sorted(before.keys() & after.keys()) if before[k].read_bytes() != after[k].read_bytes()]
    only = sorted(before.keys() ^ after.keys())
    differ = 0
    for key in changed:
        old, new = _sass(before[key]), _sass(after[key])
        if old == new:
            print(f"same SASS    {key}")
            continue
        differ += 1
        a, b = _opcodes(old), _opcodes(new)
        moved = {op: b[op] - a[op] for op in sorted(a.keys() | b.keys()) if a[op] != b[op]}
        print(f"SASS differs {key}: {len(old.splitlines())} -> {len(new.splitlines())} lines; opcodes {moved or 'same counts'}")
    for key in only:
        print(f"in one tree  {key}")
    print(f"{len(changed)} kernels changed source, {differ} of them SASS; {len(only)} in one tree only")
    return 1 if differ or only else 0


if __name__ == "__main__":
    sys.exit(main())
