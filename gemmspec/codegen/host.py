"""The C++ side of a spec: `<spec>.h` and the host launcher `<spec>_host.cu`.

Both are rendered from the launch manifest (manifest.py), so the declarations, the
launch order and every argument are the compiler's own data; the templates only lay
them out. The launcher needs the CUDA toolkit headers and the driver's
cuTensorMapEncodeTiled, which it looks up through the runtime (no -lcuda).
"""

from __future__ import annotations

from dataclasses import dataclass

from .formula import NUM_SMS, Formula
from .kernels import ENV
from .manifest import (
    MANIFEST_VERSION,
    SHARED_HEADER,
    TENSOR_MAP_BYTES,
    TENSOR_MAP_FIXED,
    WORKSPACE_ALIGN,
    KernelLaunch,
    Manifest,
    Param,
    Upload,
    Workspace,
)
from .names import header_guard


def _dim_var(name: str) -> str:
    return NUM_SMS if name == NUM_SMS else f"d_{name}"


def cexpr(f: Formula) -> str:
    """A formula as C++ over the launcher's locals (`d_<dim>`, `num_sms`)."""
    return f.c(_dim_var)


def declaration(k: KernelLaunch) -> str:
    params = ", ".join(f"{p.ctype} {p.name}" for p in k.params)
    return f'extern "C" __global__ void {k.symbol}({params});'


@dataclass(frozen=True)
class _Step:
    """One step of the launcher, as the template lays it out."""

    kind: str  # "templates", "int32", "zeros" or "kernel"
    comment: str
    workspace: int = -1  # index into the offsets array
    address_of: int = -1
    templates: tuple[tuple[str, int, int], ...] = ()  # (data type, box inner, box rows)
    values: tuple[str, ...] = ()
    symbol: str = ""
    grid: tuple[str, str, str] = ("", "", "")
    block: int = 0
    smem: int = 0
    args: tuple[str, ...] = ()
    programmatic: bool = False  # launched with the programmatic stream serialization attribute


class _Renderer:
    """Renders one step list against one workspace list (the compiled program's, or the
    decode variant's: each program lays out its own workspaces)."""

    def __init__(self, m: Manifest, workspaces: tuple[Workspace, ...] | None = None):
        self.m = m
        self.ws_index = {w.name: i for i, w in enumerate(m.workspaces if workspaces is None else workspaces)}

    def arg(self, p: Param) -> str:
        s = p.source
        pointer = p.ctype.endswith("*")
        if s.kind == "null":
            return f"static_cast<{p.ctype}>(nullptr)"
        if s.kind == "extent":
            # The launcher is given pointers, not shapes: -1 says "unknown", and the
            # check that compares this length is left out.
            return f"static_cast<{p.ctype}>(-1)"
        if s.kind == "tensor":
            expr = f"args->{s.ref}"
        elif s.kind == "workspace":
            expr = f"ws + off[{self.ws_index[s.ref]}]"
        elif s.kind == "dim":
            expr = _dim_var(s.ref)
        else:
            assert s.value is not None
            expr = cexpr(s.value)
        return f"reinterpret_cast<{p.ctype}>({expr})" if pointer else f"static_cast<{p.ctype}>({expr})"

    def step(self, s) -> _Step:
        if isinstance(s, Upload):
            if s.templates:
                maps = tuple((t.data_type, t.box_inner, t.box_rows) for t in s.templates)
                return _Step(
                    "templates", f"tensor-map templates into {s.workspace}",
                    workspace=self.ws_index[s.workspace], address_of=self.ws_index[s.address_of],
                    templates=maps,
                )
            if all(v.is_const and v.value == 0 for v in s.int32):
                # Zeros (split K's counters): one memset, however many.
                return _Step("zeros", f"{s.workspace}: zeros", workspace=self.ws_index[s.workspace],
                             values=(str(4 * len(s.int32)),))
            return _Step(
                "int32", f"{s.workspace}", workspace=self.ws_index[s.workspace],
                values=tuple(cexpr(v) for v in s.int32),
            )
        return _Step(
            "kernel", f"{s.owner}: {s.role}", symbol=s.symbol,
            grid=tuple(cexpr(g) for g in s.grid), block=s.block, smem=s.dynamic_smem,
            args=tuple(self.arg(p) for p in s.params), programmatic=s.programmatic,
        )

    def context(self) -> dict:
        m = self.m
        dims = list(m.runtime_dims)
        every_step = m.steps + (m.decode.steps if m.decode else ())
        return {
            "m": m,
            "manifest_version": MANIFEST_VERSION,
            "guard": header_guard(m.spec),
            "shared_header": SHARED_HEADER,
            "prefix": m.prefix,
            "dims": dims,
            "dim_params": ", ".join(f"long long {d}" for d in dims) or "void",
            "dim_locals": ", ".join(f"long long d_{d}" for d in dims) or "void",
            "dim_args": ", ".join(f"d_{d}" for d in dims),
            "layout_params": ", ".join([*(f"long long d_{d}" for d in dims), "long long* off"]),
            "layout_args": ", ".join([*(f"d_{d}" for d in dims), "off"]),
            "arguments": m.arguments,
            # A padded segment_major argument's buffer has more rows than its dim.
            "storage_notes": {
                a.name: f" stored in {a.pad_rows[0]} + {a.pad_rows[1]} rows (padded segments)" if a.pad_rows else ""
                for a in m.arguments
            },
            "declarations": [declaration(k) for k in m.all_kernels],
            "workspaces": [(w.name, cexpr(w.bytes)) for w in m.workspaces],
            "align": WORKSPACE_ALIGN,
            "map_bytes": TENSOR_MAP_BYTES,
            "map_fixed": TENSOR_MAP_FIXED,
            "smem_kernels": [(k.symbol, k.dynamic_smem) for k in m.all_kernels if k.raise_smem_limit],
            "steps": [self.step(s) for s in m.steps],
            "decode": self.decode(),
            "uses_templates": any(isinstance(s, Upload) and s.templates for s in every_step),
            "uses_uploads": any(isinstance(s, Upload) for s in every_step),
            "uses_programmatic": any(k.programmatic for k in m.all_kernels),
        }

    def decode(self) -> dict | None:
        """The decode variant's rule, workspaces and steps, rendered as the compiled ones."""
        d = self.m.decode
        if d is None:
            return None
        steps = _Renderer(self.m, d.workspaces)
        return {
            "dim": d.rule.dim,
            "max_rows": d.rule.max_rows,
            "rule": d.rule.describe(),
            "workspaces": [(w.name, cexpr(w.bytes)) for w in d.workspaces],
            "steps": [steps.step(s) for s in d.steps],
        }


def render_header(m: Manifest) -> str:
    return ENV.get_template("host_header.h.jinja").render(**_Renderer(m).context())


def render_host(m: Manifest) -> str:
    return ENV.get_template("host_launcher.cu.jinja").render(**_Renderer(m).context())
