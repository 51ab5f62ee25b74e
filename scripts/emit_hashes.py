"""One hash per emitted file, to show that a refactoring changes no byte.

    python scripts/emit_hashes.py > before.txt            # examples and their backward
    python scripts/emit_hashes.py --corpus specs.jsonl    # also every spec of a corpus
    python scripts/emit_hashes.py --collect specs.jsonl -- tests/front tests/codegen
    python scripts/emit_hashes.py --dump before/ > before.txt   # the files too, for sass_diff.py

Each example (and each spec of the corpus) is carried through the whole compiler: every
file `gemmspec compile` would write (kernels, host launcher, header, manifest,
schedule), the `explain` text and JSON, and the same for its derived backward spec.
One line per file: `<sha256>  <spec source>:<file>`. Compare two runs with `diff`.
`--dump DIR` also writes each file under DIR (a folder per spec source, the device
header at its top), so that `scripts/sass_diff.py` can compile the kernels two runs
disagree on and compare their SASS.

`--collect` runs pytest over the given paths with every `.gspec` text the tests parse
recorded (one JSON string per line, deduplicated), and every jinja2 render's output
hashed into `<FILE>.renders` (the kernel variants that tests build by hand, which no
spec text reaches).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sha(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def _dump(dump: Path | None, label: str, name: str, data: bytes | str) -> None:
    if dump is None:
        return
    folder = dump.joinpath(*label.split(":"))  # a backward spec's files under its forward's
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def _spec_lines(label: str, text: str, dump: Path | None = None) -> list[str]:
    from gemmspec.backward import derive_backward
    from gemmspec.codegen.emit import emit
    from gemmspec.errors import GemmspecError
    from gemmspec.explain import explain_text, schedule_json
    from gemmspec.output import plan_programs
    from gemmspec.parse import parse
    from gemmspec.pipeline import lower_file

    out: list[str] = []
    try:
        lowered = lower_file(parse(text, label))
        programs = [(x.spec, x.schedule, emit(x.spec, x.schedule)) for x in lowered]
        planned = plan_programs(programs, False)
    except GemmspecError as e:
        return [f"{_sha(str(e))}  {label}:error"]
    for sf in planned:
        for name, data in sorted(sf.files.items()):
            out.append(f"{_sha(data)}  {label}:{name}")
            _dump(dump, label, name, data)
    for x, (_, _, program) in zip(lowered, programs):
        out.append(f"{_sha(explain_text(x.spec, x.schedule))}  {label}:{x.spec.name}.explain")
        doc = json.dumps(schedule_json(x.spec, x.schedule, program), indent=2)
        out.append(f"{_sha(doc)}  {label}:{x.spec.name}.explain.json")
        try:
            bw = derive_backward(x.spec)
        except GemmspecError as e:
            out.append(f"{_sha(str(e))}  {label}:{x.spec.name}.backward-error")
            continue
        out.append(f"{_sha(repr(bw))}  {label}:{x.spec.name}.backward")
        if bw.statements:
            out.extend(_spec_lines(f"{label}:{x.spec.name}.backward", bw.source, dump))
    return out


def _collect(target: Path, paths: list[str], fast: bool = False) -> int:
    import jinja2
    import pytest

    import gemmspec.parse as parse_mod

    texts: dict[str, None] = {}
    renders: dict[str, None] = {}
    original_parse = parse_mod.parse
    original_render = jinja2.Template.render

    def recording_parse(text, *args, **kwargs):
        texts[text] = None
        return original_parse(text, *args, **kwargs)

    def recording_render(self, *args, **kwargs):
        result = original_render(self, *args, **kwargs)
        renders[_sha(result)] = None
        return result

    parse_mod.parse = recording_parse
    jinja2.Template.render = recording_render
    if fast:
        # Specs are parsed and kernels rendered before anything compiles: with NVRTC and
        # the C++ compiler stubbed out (the tests that need them fail), the run takes
        # minutes, not the suite's half hour.
        import subprocess

        import gemmspec.runtime.nvrtc as nvrtc

        def refuse(*args, **kwargs):
            raise RuntimeError("compilation stubbed out while collecting")

        import gemmspec.runtime.executor  # noqa: F401  (imports compile_cubin by name)
        import gemmspec.runtime.quantize  # noqa: F401

        original = nvrtc.compile_cubin
        for mod in list(sys.modules.values()):
            if getattr(mod, "compile_cubin", None) is original:
                mod.compile_cubin = refuse
        subprocess.run = refuse
    # Modules that imported `parse` by name before this point keep the original: patch
    # them too.
    for name, mod in list(sys.modules.items()):
        if name.startswith("gemmspec") and getattr(mod, "parse", None) is original_parse:
            mod.parse = recording_parse
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "--hypothesis-seed=0", *paths])
    with target.open("w") as f:
        for text in texts:
            f.write(json.dumps(text) + "\n")
    Path(str(target) + ".renders").write_text("".join(f"{h}\n" for h in sorted(renders)))
    print(f"{len(texts)} spec texts, {len(renders)} distinct renders; pytest exit {rc}", file=sys.stderr)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, help="a file of spec texts, one JSON string per line")
    ap.add_argument("--collect", type=Path, help="run pytest over PATHS and record spec texts here")
    ap.add_argument("--fast", action="store_true", help="with --collect: stub out NVRTC and nvcc")
    ap.add_argument("--dump", type=Path, help="also write every emitted file under this folder")
    ap.add_argument("paths", nargs="*")
    args = ap.parse_args()
    if args.collect is not None:
        return _collect(args.collect, args.paths or ["tests"], args.fast)
    lines: list[str] = []
    if args.dump is not None:  # the device header the kernels include, as this tree has it
        from gemmspec.codegen.kernels import include_dir

        args.dump.mkdir(parents=True, exist_ok=True)
        for header in Path(include_dir()).glob("*.cuh"):
            (args.dump / header.name).write_bytes(header.read_bytes())
    for path in sorted((ROOT / "examples").glob("*.gspec")):
        lines.extend(_spec_lines(f"examples/{path.name}", path.read_text(), args.dump))
    if args.corpus is not None:
        for i, line in enumerate(args.corpus.read_text().splitlines()):
            lines.extend(_spec_lines(f"corpus#{i}", json.loads(line), args.dump))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
