"""The launch manifest: every kernel of a spec in launch order, with its arguments.

Built from the compiler's own data (the spec, the schedule and the emitted kernel
configurations), never from CUDA text. Three things read it: `<spec>.manifest.json`
(a versioned contract, docs/kernel-abi.md), the emitted C++ header and host launcher
(codegen/host.py) and the Python runtime, which walks the same steps. Run-time
quantities are `Formula`s over the spec's run-time dims (and `num_sms` for grids).

The device check of the offsets (codegen/validate.py) is part of it: its flags and the
checked copies of the offsets are the first workspaces, every later step reads the
copies, and it runs in launch 0's leaf-table builder or as a `check` step of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ..lower.schedule import PrePass
from ..spec import INDEX_TYPE, Spec, Tensor
from .emit import (
    COPY_RECORD_BYTES,
    DSCALE_RECORD_BYTES,
    EPILOGUE_RECORD_BYTES,
    GATHER_RECORD_BYTES,
    LEAF_RECORD_BYTES,
    TABLE_THREADS,
    EmittedCheck,
    EmittedLaunch,
    EmittedPostPass,
    EmittedPrePass,
    EmittedProgram,
    table_record_bytes,
)
from .formula import NUM_SMS, Formula
from .kernels import (
    CTYPES,
    ELEMENT_BYTES,
    INLINE_MAX_BLOCKS,
    SCATTER_AUX_THREADS,
    SCATTER_SCAN_THREADS,
    SCATTER_STEPS,
    GemmKernelConfig,
    QuantizeKernelConfig,
    map_specs,
)
from .names import file_stem, host_prefix
from .validate import THREADS as CHECK_THREADS
from .validate import Check, CheckParam, group_chain_count, prepass_offsets
from .variants import DecodeRule, DecodeVariant, decode_json

MANIFEST_VERSION = 2
TARGET = "sm_90a"
# The leaf table's record sizes (the emitter's, which lays the records out):
LEAF_BYTES = LEAF_RECORD_BYTES  # sizeof(GsLeaf), docs/kernel-abi.md
EPILOGUE_BYTES = EPILOGUE_RECORD_BYTES  # sizeof(GsEpilogue): per leaf, after the leaf table, with an epilogue
GATHER_BYTES = GATHER_RECORD_BYTES  # sizeof(GsGather): per leaf, after those, with rows through index tensors
DSCALE_BYTES = DSCALE_RECORD_BYTES  # sizeof(GsDScale): per leaf, after those, with an FP8 output
COPY_BYTES = COPY_RECORD_BYTES  # sizeof(GsCopy): per leaf, after those, with an FP8 output's copy
TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap)
WORKSPACE_ALIGN = 256  # every workspace starts at a multiple of this in the one buffer
SHARED_HEADER = "gemmspec_ptx.cuh"
# cuTensorMapEncodeTiled's element type per dtype: FP8 moves as bytes (TMA only copies).
TENSOR_MAP_DATA_TYPE = {
    "e4m3": "CU_TENSOR_MAP_DATA_TYPE_UINT8",
    "e5m2": "CU_TENSOR_MAP_DATA_TYPE_UINT8",
    "bf16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
    "f16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
    "f32": "CU_TENSOR_MAP_DATA_TYPE_FLOAT32",
}
# What every template shares (gemmspec/runtime/tensormap.py encodes the same).
TENSOR_MAP_FIXED = {
    "rank": 2,
    "swizzle": "CU_TENSOR_MAP_SWIZZLE_128B",
    "interleave": "CU_TENSOR_MAP_INTERLEAVE_NONE",
    "l2_promotion": "CU_TENSOR_MAP_L2_PROMOTION_L2_256B",
    "oob_fill": "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE",
    "row_stride_bytes": 128,
}
# The operands whose base pointers the leaf-table builder takes, in parameter order.
TABLE_OPERANDS = ("a", "b", "d")
CHECK_FLAGS = "check.flags"  # the workspace of the check's flags: the first of the call's


@dataclass(frozen=True)
class Argument:
    """One run-time argument of a call: a field of `<prefix>_args`, a keyword in Python."""

    name: str
    role: str  # "input", "output", "scale", "offsets", "counts" or "index"
    dtype: str  # element type; "f32" for scales, "i32" for offsets and counts
    ctype: str  # the field's C++ type
    dims: tuple[str, ...] = ()  # tensors: dims as declared
    scale_of: str | None = None  # scales: the tensor they scale
    group: str | None = None  # offsets/counts: the group they describe
    # segment_major(G) pad P: the buffer holds `pad_rows[1]` more rows along dim
    # `pad_rows[0]` than the dim has (P - 1 per segment of G).
    pad_rows: tuple[str, int] | None = None


@dataclass(frozen=True)
class Source:
    """Where a kernel parameter's value comes from."""

    kind: str  # "tensor", "workspace", "dim", "value", "extent" or "null"
    ref: str = ""  # tensor, workspace or dim name; "extent": an argument
    value: Formula | None = None  # kind "value"
    axis: int = 0  # kind "extent": the argument's length along this axis

    def text(self) -> str:
        return str(self.value) if self.kind == "value" else self.ref


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str
    source: Source


@dataclass(frozen=True)
class Workspace:
    name: str
    bytes: Formula
    purpose: str


@dataclass(frozen=True)
class MapTemplate:
    """One tensor-map template (cuTensorMapEncodeTiled) of a launch; see TENSOR_MAP_FIXED."""

    operand: str  # "a", "b", "d", or "u" (a SwiGLU's up rows)
    dtype: str
    box_inner: int  # contiguous elements per box row (one 128-byte swizzle row)
    box_rows: int

    @property
    def data_type(self) -> str:
        return TENSOR_MAP_DATA_TYPE[self.dtype]


@dataclass(frozen=True)
class Upload:
    """Bytes a step writes into a workspace before the kernels that read it: tensor-map
    templates (encoded at the address of workspace `address_of`) or int32 values."""

    workspace: str
    templates: tuple[MapTemplate, ...] = ()
    address_of: str = ""
    int32: tuple[Formula, ...] = ()


@dataclass(frozen=True)
class KernelLaunch:
    # "check", "transpose", "requantize", "quantize", "swiglu_grad", "gather", "leaf_table",
    # "gemm", "rowdot", "rowscale", or one of scatter_add's steps: "scatter_zero",
    # "scatter_count", "scatter_scan", "scatter_place", "scatter_add"
    role: str
    symbol: str
    file: str
    owner: str  # "check", "prepass <i>", "launch <i>" or "postpass <i>"
    grid: tuple[Formula, Formula, Formula]
    block: int
    dynamic_smem: int
    cluster: int  # CTAs per cluster along x, fixed in the kernel (__cluster_dims__)
    params: tuple[Param, ...]
    # Launched with the programmatic stream serialization attribute: it may start while
    # the step before it runs, and waits for that step (griddepcontrol.wait) before it
    # reads what the step wrote. An ordinary launch is also correct.
    programmatic: bool = False

    @property
    def raise_smem_limit(self) -> bool:
        """Above 48 KB a kernel needs cudaFuncAttributeMaxDynamicSharedMemorySize."""
        return self.dynamic_smem > 48 * 1024


Step = Upload | KernelLaunch


@dataclass(frozen=True)
class OffsetsCheck:
    """The device check of a call's offsets, counts and index tensors: which kernel runs
    it (launch 0's leaf-table builder, or a `check` step of its own), and the flags it
    writes into workspace CHECK_FLAGS, one int32 per check (1: that check failed, and
    every launch computed nothing)."""

    symbol: str
    fused: bool
    checks: tuple[Check, ...]

    def to_json(self) -> dict:
        return {
            "symbol": self.symbol,
            "fused": self.fused,
            "flags": CHECK_FLAGS,
            "checks": [{"tensor": c.tensor, "message": c.message} for c in self.checks],
        }


@dataclass(frozen=True)
class DecodeChoice:
    """The decode variant a call takes by its run-time dim (codegen/variants.py), as the
    files describe it: the rule, the variant's files (its changed launches' sources under
    names of their own), and its own workspaces and step list, which the launcher runs in
    place of the compiled ones. Both are whole lists: beside the changed launches' GEMM
    kernels, their tensor-map templates (other boxes), split-K workspaces and counters
    (other tile counts) and leaf-table builders (where a launch has one) differ too."""

    rule: DecodeRule
    launches: tuple[tuple[int, str, str], ...]  # (launch index, kernel as compiled, decode kernel)
    files: dict[str, str]  # output file name -> the file name in the variant's sources
    workspaces: tuple[Workspace, ...]
    steps: tuple[Step, ...]

    @property
    def kernels(self) -> tuple[KernelLaunch, ...]:
        return tuple(s for s in self.steps if isinstance(s, KernelLaunch))

    def to_json(self) -> dict:
        return {
            **decode_json(self.rule, self.launches),
            "files": sorted(self.files),
            "workspaces": [_workspace_json(w) for w in self.workspaces],
            "steps": [_step_json(s) for s in self.steps],
        }


@dataclass(frozen=True)
class Manifest:
    spec: str
    source: str  # the .gspec file
    stem: str
    runtime_dims: tuple[str, ...]
    arguments: tuple[Argument, ...]
    workspaces: tuple[Workspace, ...]
    steps: tuple[Step, ...]
    offsets_check: OffsetsCheck | None = None
    decode: DecodeChoice | None = None  # the kernels a call may take instead, by its size

    @property
    def kernels(self) -> tuple[KernelLaunch, ...]:
        return tuple(s for s in self.steps if isinstance(s, KernelLaunch))

    @property
    def all_kernels(self) -> tuple[KernelLaunch, ...]:
        """Every kernel the launcher may launch: the compiled steps', then the decode
        variant's that differ (each symbol once)."""
        seen = {k.symbol for k in self.kernels}
        extra = [k for k in self.decode.kernels if k.symbol not in seen] if self.decode else []
        return self.kernels + tuple(dict((k.symbol, k) for k in extra).values())

    @property
    def prefix(self) -> str:
        return host_prefix(self.spec)

    @property
    def files(self) -> dict[str, object]:
        return {
            "kernels": sorted({k.file for k in self.all_kernels}),
            "host": f"{self.stem}_host.cu",
            "header": f"{self.stem}.h",
            "device_header": SHARED_HEADER,
            "schedule": f"{self.stem}.schedule.json",
            "manifest": f"{self.stem}.manifest.json",
        }

    def workspace(self, name: str) -> Workspace:
        return next(w for w in self.workspaces if w.name == name)

    def to_json(self) -> dict:
        doc = {
            "manifest_version": MANIFEST_VERSION,
            "spec": self.spec,
            "source": self.source,
            "target": TARGET,
            "files": self.files,
            "host_api": {
                "args_struct": f"{self.prefix}_args",
                "run": f"{self.prefix}_run",
                "workspace_bytes": f"{self.prefix}_workspace_bytes",
            },
            "runtime_dims": list(self.runtime_dims),
            "arguments": [_argument_json(a) for a in self.arguments],
            "workspace_align": WORKSPACE_ALIGN,
            "workspaces": [_workspace_json(w) for w in self.workspaces],
            "steps": [_step_json(s) for s in self.steps],
        }
        if self.offsets_check is not None:
            doc["offsets_check"] = self.offsets_check.to_json()
        if self.decode is not None:  # only where a launch has a decode variant
            doc["run_time_choice"] = self.decode.to_json()
        return doc

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"


def _workspace_json(w: Workspace) -> dict:
    return {"name": w.name, "bytes": str(w.bytes), "purpose": w.purpose}


def _argument_json(a: Argument) -> dict:
    doc: dict = {"name": a.name, "role": a.role, "dtype": a.dtype, "ctype": a.ctype}
    if a.role in ("input", "output", "index"):
        doc["dims"] = list(a.dims)
    if a.scale_of is not None:
        doc["scale_of"] = a.scale_of
    if a.group is not None:
        doc["group"] = a.group
    if a.pad_rows is not None:
        doc["pad_rows"] = {"dim": a.pad_rows[0], "rows": a.pad_rows[1]}
    return doc


def _step_json(s: Step) -> dict:
    if isinstance(s, Upload):
        if s.templates:
            contents = {
                "type": "tensor_map_templates",
                "address_of": s.address_of,
                **TENSOR_MAP_FIXED,
                "maps": [
                    {
                        "operand": m.operand,
                        "dtype": m.dtype,
                        "data_type": m.data_type,
                        "box": [m.box_inner, m.box_rows],
                    }
                    for m in s.templates
                ],
            }
        else:
            contents = {"type": "int32", "values": [str(v) for v in s.int32]}
        return {"kind": "upload", "workspace": s.workspace, "contents": contents}
    return {
        "kind": "kernel",
        "role": s.role,
        "owner": s.owner,
        "symbol": s.symbol,
        "file": s.file,
        "grid": [str(g) for g in s.grid],
        "block": [s.block, 1, 1],
        "cluster": [s.cluster, 1, 1],
        "dynamic_smem_bytes": s.dynamic_smem,
        "set_max_dynamic_smem": s.raise_smem_limit,
        "programmatic_serialization": s.programmatic,
        "params": [_param_json(p) for p in s.params],
    }


def _param_json(p: Param) -> dict:
    doc = {"name": p.name, "ctype": p.ctype, "kind": p.source.kind, "ref": p.source.text()}
    if p.source.kind == "extent":
        doc["axis"] = p.source.axis
    return doc


# ---- building ----------------------------------------------------------------------------


def _ptr(dtype: str, const: bool = True) -> str:
    return f"{'const ' if const else ''}{CTYPES[dtype]}*"


def spec_arguments(spec: Spec) -> tuple[Argument, ...]:
    """Every run-time tensor of a call, in the order the Python API lists them: each
    tensor no pass derives (then its scale), then each group's offsets or counts. An
    i32 tensor is an index tensor (role "index": rows read or written through it)."""
    written = set(spec.written)  # an FP8 output's copy and row passes' targets too
    out: list[Argument] = []
    for t in spec.tensors:
        if t.derived is not None:
            continue
        role = "output" if t.name in written else "index" if t.dtype == INDEX_TYPE else "input"
        pad = (t.dims[t.layout.seg_axis], t.layout.pad_rows) if t.layout.pad_rows else None
        out.append(Argument(t.name, role, t.dtype, _ptr(t.dtype, role != "output"), t.dims, pad_rows=pad))
        if t.scale is not None:
            # An FP8 output's scales are written with it.
            ctype = "float*" if role == "output" else "const float*"
            out.append(Argument(t.scale.name, "scale", "f32", ctype, scale_of=t.name))
    for g in spec.groups:
        if g.tensor:
            role = "counts" if g.kind == "masked" else "offsets"
            out.append(Argument(g.tensor, role, "i32", "const int*", group=g.name))
    return tuple(out)


def dim_formula(spec: Spec, name: str) -> Formula:
    size = spec.dim(name).size
    return Formula.var(name) if size is None else Formula.const(size)


def _layout_formula(spec: Spec, p) -> Formula:
    unknown = p.symbols - set(spec.runtime_dims)
    assert not unknown, f"stride {p} uses {sorted(unknown)}, which are not run-time dims"
    return Formula.poly(p)


def tensor_elements(spec: Spec, t: Tensor) -> Formula:
    """Elements a tensor's storage holds: for a strided layout the elements it reaches,
    1 + sum (n_i - 1) * s_i (0 when empty); for segment_major the elements of its storage
    shape (the padding rows of `pad P` included)."""
    if t.layout.kind != "strided":
        total = Formula.const(1)
        for axis, d in enumerate(t.dims):
            rows = dim_formula(spec, d)
            if axis == t.layout.seg_axis and t.layout.pad_rows:
                rows = rows + t.layout.pad_rows
            total = total * rows
        return total
    reach = Formula.const(1)
    for d, s in zip(t.dims, t.layout.strides):
        reach = reach + (dim_formula(spec, d) - 1) * _layout_formula(spec, s)
    return reach.max(0) if not reach.is_const else reach


class _Builder:
    def __init__(self, spec: Spec, program: EmittedProgram, stem: str):
        self.spec = spec
        self.program = program
        self.stem = stem
        self.workspaces: list[Workspace] = []
        self.steps: list[Step] = []
        # Where each tensor a kernel reads lives: a spec argument, or a workspace a
        # pre-pass writes (a transpose's target shares its source's scales), or the
        # checked copy of an offsets or counts tensor.
        self.where: dict[str, Source] = {a.name: Source("tensor", a.name) for a in spec_arguments(spec)}
        self.check_params: tuple[Param, ...] = ()

    def workspace(self, name: str, nbytes: Formula, purpose: str) -> Source:
        self.workspaces.append(Workspace(name, nbytes, purpose))
        return Source("workspace", name)

    def dim(self, name: str) -> Formula:
        return dim_formula(self.spec, name)

    def value(self, f: Formula | int) -> Source:
        return Source("value", value=Formula.of(f))

    # ---- the offsets check ----------------------------------------------------------------
    def offsets_check(self, c: EmittedCheck) -> None:
        """The check's workspaces come first; from here on every kernel reads the checked
        copies. Fused, its parameters go to launch 0's builder; else its step runs first."""
        v = c.kernel
        assert not self.workspaces, "the flags are documented at the start of the workspace"
        flags = self.workspace(
            CHECK_FLAGS, Formula.const(4 * max(len(v.checks), 1)), "the flags of the offsets check, one int32 per check"
        )
        copies: dict[str, Source] = {}
        # A GEMM that builds its table itself checks into its blocks' shared memory.
        inline = bool(c.fused and self.program.launches and self.program.launches[0].gemm.inline_table)
        if inline:
            self.check_params = tuple(
                Param(p.name, p.ctype, self.check_source(p, flags, copies)) for p in v.inline_params
            )
            return
        for t, n in zip(v.tensors, v.copy_ints):
            copies[t] = self.workspace(
                f"check.{t}", Formula.const(4 * n), f"the checked copy of '{t}' (all zeros when a check failed)"
            )
        self.check_params = tuple(Param(p.name, p.ctype, self.check_source(p, flags, copies)) for p in v.params)
        for t, copy in copies.items():
            self.where[t] = copy
        if not c.fused:
            one = Formula.const(1)
            self.steps.append(
                KernelLaunch(
                    "check", v.name, f"{self.stem}_check.cu", "check", (one, one, one),
                    CHECK_THREADS, 0, 1, self.check_params,
                )
            )

    def check_source(self, p: CheckParam, flags: Source, copies: dict[str, Source]) -> Source:
        if p.kind == "flags":
            return flags
        if p.kind == "input":
            return Source("tensor", p.ref)
        if p.kind == "checked":
            return copies[p.ref]
        if p.kind == "index":
            return self.where[p.ref]
        if p.kind == "size":
            return Source("dim", p.ref) if self.spec.dim(p.ref).size is None else self.value(self.dim(p.ref))
        assert p.kind == "rows", p
        return Source("extent", p.ref, axis=p.axis)

    # ---- pre-passes --------------------------------------------------------------------
    def prepass(self, index: int, e: EmittedPrePass) -> None:
        p = e.prepass
        src, dst = self.spec.tensor(p.source), self.spec.tensor(p.target)
        file = f"{self.stem}_prepass{index}.cu"
        if p.kind == "transpose":
            self.transpose(index, e, p, src, dst, file)
        elif isinstance(e.config, QuantizeKernelConfig):  # quantize, or swiglu_grad into [1, 128]
            self.quantize(index, e, src, dst, file)
        elif p.kind == "gather":
            self.gather(index, e, p, src, dst, file)
        else:
            self.requantize(index, e, p, src, dst, file)

    def transpose(self, index, e, p: PrePass, src: Tensor, dst: Tensor, file: str) -> None:
        cfg = e.config
        # The kernel reads rows along the source's contiguous axis and writes rows along
        # the target's; a third axis, if any, is the batch.
        a, b = src.layout.contiguous_axis(), dst.layout.contiguous_axis()
        assert a is not None and b is not None and a != b and src.rank in (2, 3), p
        rest = [i for i in range(src.rank) if i not in (a, b)]
        batch = self.dim(src.dims[rest[0]]) if rest else Formula.const(1)
        k, n = self.dim(src.dims[b]), self.dim(src.dims[a])
        in_bs = _layout_formula(self.spec, src.layout.strides[rest[0]]) if rest else Formula.const(0)
        out_bs = _layout_formula(self.spec, dst.layout.strides[rest[0]]) if rest else Formula.const(0)
        out = self.workspace(
            f"prepass{index}.{dst.name}",
            tensor_elements(self.spec, dst) * ELEMENT_BYTES[dst.dtype],
            f"'{dst.name}', the transposed copy of '{src.name}'",
        )
        params = (
            Param("in", "const unsigned char*", self.where[src.name]),
            Param("out", "unsigned char*", out),
            Param("batch", "int", self.value(batch)),
            Param("K", "int", self.value(k)),
            Param("N", "int", self.value(n)),
            Param("in_bs", "long long", self.value(in_bs)),
            Param("in_ldk", "long long", self.value(_layout_formula(self.spec, src.layout.strides[b]))),
            Param("out_bs", "long long", self.value(out_bs)),
            Param("out_ldn", "long long", self.value(_layout_formula(self.spec, dst.layout.strides[a]))),
        )
        grid = (n.ceil_div(cfg.tile), k.ceil_div(cfg.tile), batch)
        self.steps.append(
            KernelLaunch("transpose", e.kernel, file, f"prepass {index}", grid, cfg.threads, 0, 1, params)
        )
        self.where[dst.name] = out
        self.where[dst.scale.name] = self.where[src.scale.name]  # the scales are shared

    def requantize(self, index, e, p: PrePass, src: Tensor, dst: Tensor, file: str) -> None:
        cfg = e.config
        # The target's rows: the source's, or those the index names.
        tokens, channels = self.dim(dst.dims[0]), self.dim(dst.dims[1])
        offsets, groups = self.requant_segments(index, dst, tokens)
        # A padded segment_major target needs up to pad - 1 more rows per segment.
        y = self.workspace(
            f"prepass{index}.{dst.name}",
            (tokens + dst.layout.pad_rows) * channels * ELEMENT_BYTES[dst.dtype],
            f"'{dst.name}', '{src.name}' requantized"
            + (f" (segments padded to multiples of {dst.layout.pad} tokens)" if dst.layout.padded else ""),
        )
        # Upper bound on the scale rows: sum_g ceil(len_g / block_t) <= ceil(T / block_t) + G.
        rows = tokens.ceil_div(cfg.block_t) + groups
        sy = self.workspace(
            f"prepass{index}.{dst.scale.name}", rows * channels * 4, f"the scales of '{dst.name}'"
        )
        if p.kind == "swiglu_grad":  # the gradient of the SwiGLU's output in place of the scales
            dh = self.spec.tensor(p.other)
            scaling = (
                Param("DH", _ptr(dh.dtype), self.where[dh.name]),
                Param("dh_ld", "long long", self.value(_layout_formula(self.spec, dh.layout.strides[0]))),
            )
        else:
            strides = src.scale.layout.strides
            scaling = (
                Param("SX", "const float*", self.where[src.scale.name]),
                Param("sx_st", "long long", self.value(_layout_formula(self.spec, strides[0]))),
                Param("sx_sc", "long long", self.value(_layout_formula(self.spec, strides[1]))),
            )
        params = (
            Param("X", _ptr(src.dtype), self.where[src.name]),
            Param("ldx", "long long", self.value(_layout_formula(self.spec, src.layout.strides[0]))),
            *scaling,
            Param("offsets", "const int*", offsets),
            Param("G", "int", self.value(groups)),
            Param("T", "int", self.value(tokens)),
            Param("C", "int", self.value(channels)),
            Param("Y", _ptr(dst.dtype, const=False), y),
            Param("SY", "float*", sy),
        )
        if p.index is not None:
            params += (
                Param("idx", "const int*", self.where[p.index]),
                Param("S", "int", self.value(self.dim(src.dims[0]))),
            )
        if p.weight is not None:
            params += (Param("W", "const float*", self.where[p.weight]),)
        grid = (rows, channels.ceil_div(cfg.tile_c), Formula.const(1))
        role = "swiglu_grad" if p.kind == "swiglu_grad" else "requantize"
        self.steps.append(KernelLaunch(role, e.kernel, file, f"prepass {index}", grid, cfg.threads, 0, 1, params))
        self.where[dst.name], self.where[dst.scale.name] = y, sy

    def quantize(self, index, e, src: Tensor, dst: Tensor, file: str) -> None:
        cfg = e.config
        # [R, C] is one batch entry of [B, R, C]; the target is dense row-major.
        batch_dims = src.dims[:-2]
        batch = self.dim(batch_dims[0]) if batch_dims else Formula.const(1)
        rows, cols = self.dim(src.dims[-2]), self.dim(src.dims[-1])
        strides = src.layout.strides
        x_bs = _layout_formula(self.spec, strides[0]) if batch_dims else Formula.const(0)
        y = self.workspace(
            f"prepass{index}.{dst.name}",
            batch * rows * cols * ELEMENT_BYTES[dst.dtype],
            f"'{dst.name}', '{src.name}' quantized",
        )
        row_blocks = rows if cfg.block_r == 1 else rows.ceil_div(cfg.block_r)
        sy = self.workspace(
            f"prepass{index}.{dst.scale.name}",
            batch * row_blocks * cols.ceil_div(cfg.block_c) * 4,
            f"the scales of '{dst.name}'",
        )
        params = (
            Param("X", _ptr(src.dtype), self.where[src.name]),
            Param("x_bs", "long long", self.value(x_bs)),
            Param("x_ldr", "long long", self.value(_layout_formula(self.spec, strides[-2]))),
            Param("Y", _ptr(dst.dtype, const=False), y),
            Param("SY", "float*", sy),
            Param("B", "int", self.value(batch)),
            Param("R", "int", self.value(rows)),
            Param("C", "int", self.value(cols)),
        )
        if cfg.swiglu_grad:  # the gradient of the SwiGLU's output, one column per pair
            dh = self.spec.tensor(e.prepass.other)
            params += (
                Param("DH", _ptr(dh.dtype), self.where[dh.name]),
                Param("dh_ldr", "long long", self.value(_layout_formula(self.spec, dh.layout.strides[0]))),
            )
        grid = (rows.ceil_div(cfg.rows_per_cta), cols.ceil_div(cfg.block_c), batch)
        role = "swiglu_grad" if cfg.swiglu_grad else "quantize"
        self.steps.append(
            KernelLaunch(role, e.kernel, file, f"prepass {index}", grid, cfg.threads, 0, 1, params)
        )
        self.where[dst.name], self.where[dst.scale.name] = y, sy

    def gather(self, index, e, p: PrePass, src: Tensor, dst: Tensor, file: str) -> None:
        cfg = e.config
        rows, cols = self.dim(dst.dims[0]), self.dim(dst.dims[1])
        y = self.workspace(
            f"prepass{index}.{dst.name}",
            rows * cols * ELEMENT_BYTES[dst.dtype],
            f"'{dst.name}', the rows of '{src.name}' that '{p.index}' names",
        )
        params = [
            Param("X", "const unsigned char*", self.where[src.name]),
            Param("ldx", "long long", self.value(_layout_formula(self.spec, src.layout.strides[0]))),
            Param("idx", "const int*", self.where[p.index]),
            Param("T", "int", self.value(rows)),
            Param("S", "int", self.value(self.dim(src.dims[0]))),
            Param("C", "int", self.value(cols)),
            Param("Y", "unsigned char*", y),
            Param("ldy", "long long", self.value(_layout_formula(self.spec, dst.layout.strides[0]))),
        ]
        if dst.scale is not None:
            sy = self.workspace(
                f"prepass{index}.{dst.scale.name}",
                rows * cols.ceil_div(dst.scale.block[1]) * 4,
                f"the scales of '{dst.name}'",
            )
            sx, sd = src.scale.layout.strides, dst.scale.layout.strides
            params += [
                Param("SX", "const float*", self.where[src.scale.name]),
                Param("sx_r", "long long", self.value(_layout_formula(self.spec, sx[0]))),
                Param("sx_c", "long long", self.value(_layout_formula(self.spec, sx[1]))),
                Param("SY", "float*", sy),
                Param("sy_r", "long long", self.value(_layout_formula(self.spec, sd[0]))),
                Param("sy_c", "long long", self.value(_layout_formula(self.spec, sd[1]))),
            ]
            self.where[dst.scale.name] = sy
        grid = (rows.ceil_div(cfg.rows_per_cta), Formula.const(1), Formula.const(1))
        self.steps.append(
            KernelLaunch("gather", e.kernel, file, f"prepass {index}", grid, cfg.threads, 0, 1, tuple(params))
        )
        self.where[dst.name] = y

    def requant_segments(self, index: int, dst: Tensor, tokens: Formula) -> tuple[Source, Formula]:
        """The segments the requantize kernel restarts its scale blocks at, as a monotone
        int32 list of G + 1 offsets: the target's segment_major group (a nested group's
        rows, flattened, repeat each row end once, which adds empty segments), or one
        segment spanning every token."""
        if dst.layout.kind == "segment_major":
            g = self.spec.group(dst.layout.group)
            if g.tensor:
                # The check's placement knows this pass reads the offsets (so the check runs first).
                assert prepass_offsets(self.spec, self.program.prepasses[index].prepass) == g.tensor
                flat = (g.count + 1) * group_chain_count(self.spec, g.name)
                return self.where[g.tensor], Formula.const(flat - 1)
            values = tuple(Formula.const(s) for s in (*g.starts, sum(g.sizes)))
        else:
            values = (Formula.const(0), tokens)
        name = f"prepass{index}.offsets"
        src = self.workspace(name, Formula.const(4 * len(values)), f"the segment offsets of '{dst.name}'")
        self.steps.append(Upload(name, int32=values))
        return src, Formula.const(len(values) - 1)

    # ---- row passes after the launches ---------------------------------------------------
    def postpass(self, index: int, e: EmittedPostPass) -> None:
        p, cfg = e.postpass, e.config
        src, dst = self.spec.tensor(p.source), self.spec.tensor(p.target)
        file = f"{self.stem}_postpass{index}.cu"
        rows, cols = self.dim(src.dims[0]), self.dim(src.dims[1])
        lda = Param("lda", "long long", self.value(_layout_formula(self.spec, src.layout.strides[0])))
        if p.kind == "scatter_add":
            self.scatter_add(index, e, src, dst, file, lda)
            return
        if p.kind == "rowdot":
            other = self.spec.tensor(p.other)
            params = (
                Param("A", _ptr(src.dtype), self.where[src.name]),
                lda,
                Param("B", _ptr(other.dtype), self.where[other.name]),
                Param("ldb", "long long", self.value(_layout_formula(self.spec, other.layout.strides[0]))),
            )
            if other.scale is not None:
                st = other.scale.layout.strides
                params += (
                    Param("SB", "const float*", self.where[other.scale.name]),
                    Param("sb_r", "long long", self.value(_layout_formula(self.spec, st[0]))),
                    Param("sb_c", "long long", self.value(_layout_formula(self.spec, st[1]))),
                )
            params += (
                Param("R", "int", self.value(rows)),
                Param("C", "int", self.value(cols)),
                Param("Y", "float*", self.where[dst.name]),
            )
        else:
            params = (
                Param("A", _ptr(src.dtype), self.where[src.name]),
                lda,
                Param("W", "const float*", self.where[p.weight]),
                Param("R", "int", self.value(rows)),
                Param("C", "int", self.value(cols)),
                Param("Y", _ptr(dst.dtype, const=False), self.where[dst.name]),
                Param("ldy", "long long", self.value(_layout_formula(self.spec, dst.layout.strides[0]))),
            )
        grid = (rows.ceil_div(cfg.rows_per_cta), Formula.const(1), Formula.const(1))
        self.steps.append(
            KernelLaunch(p.kind, e.kernel, file, f"postpass {index}", grid, cfg.threads, 0, 1, params)
        )

    def scatter_add(self, index: int, e: EmittedPostPass, src: Tensor, dst: Tensor, file: str, lda: Param) -> None:
        """Five kernels (SCATTER_STEPS): zero the counts and cursors, count each target
        row's entries, scan the counts into bucket starts, place each entry t in its row's
        bucket, then one warp per target row sorts its bucket and adds its rows."""
        cfg, p = e.config, e.postpass
        t_rows, s_rows = self.dim(src.dims[0]), self.dim(dst.dims[0])
        one = Formula.const(1)
        counts = self.workspace(
            f"postpass{index}.counts", (s_rows + 1) * 4,
            f"the entries of '{p.index}' per row of '{dst.name}', then their bucket starts (int32, {dst.dims[0]} + 1)",
        )
        cursors = self.workspace(
            f"postpass{index}.cursors", s_rows * 4,
            f"the fill cursor of each bucket of '{dst.name}' (int32, {dst.dims[0]})",
        )
        slots = self.workspace(
            f"postpass{index}.slots", t_rows * 4,
            f"the rows t of '{src.name}' in their buckets, as placed (int32, {src.dims[0]})",
        )
        order = self.workspace(
            f"postpass{index}.order", t_rows * 4,
            f"the rows t of '{src.name}' in their buckets, ascending (int32, {src.dims[0]})",
        )
        idx = Param("IDX", "const int*", self.where[p.index])
        n_t, n_s = Param("T", "int", self.value(t_rows)), Param("S", "int", self.value(s_rows))
        aux = SCATTER_AUX_THREADS
        steps = {
            "scatter_zero": (
                ((s_rows + 1).ceil_div(aux), one, one), aux,
                (Param("COUNTS", "int*", counts), Param("CURSORS", "int*", cursors), n_s),
            ),
            "scatter_count": (
                (t_rows.ceil_div(aux), one, one), aux,
                (idx, n_t, n_s, Param("COUNTS", "int*", counts)),
            ),
            "scatter_scan": ((one, one, one), SCATTER_SCAN_THREADS, (Param("COUNTS", "int*", counts), n_s)),
            "scatter_place": (
                (t_rows.ceil_div(aux), one, one), aux,
                (idx, n_t, n_s, Param("COUNTS", "const int*", counts), Param("CURSORS", "int*", cursors),
                 Param("SLOTS", "int*", slots)),
            ),
            "scatter_add": (
                (s_rows.ceil_div(cfg.rows_per_cta), one, one), cfg.threads,
                (
                    Param("A", _ptr(src.dtype), self.where[src.name]), lda,
                    Param("COUNTS", "const int*", counts), Param("SLOTS", "const int*", slots),
                    Param("ORDER", "int*", order), n_s, Param("C", "int", self.value(self.dim(src.dims[1]))),
                    Param("Y", _ptr(dst.dtype, const=False), self.where[dst.name]),
                    Param("ldy", "long long", self.value(_layout_formula(self.spec, dst.layout.strides[0]))),
                ),
            ),
        }
        for (role, _), symbol in zip(SCATTER_STEPS, e.kernels):
            grid, block, params = steps[role]
            self.steps.append(KernelLaunch(role, symbol, file, f"postpass {index}", grid, block, 0, 1, params))

    # ---- launches ----------------------------------------------------------------------
    def launch(self, x: EmittedLaunch) -> None:
        i, cfg, pg = x.launch.index, x.gemm, x.launch.problems
        file = f"{self.stem}_launch{i}.cu"
        maps = tuple(MapTemplate(m.operand, m.dtype, m.box_inner, m.box_rows) for m in map_specs(cfg))
        if cfg.inline_table:
            self.inline_launch(x, file, maps)
            return
        # The records (the GEMM kernel finds the per-leaf ones after the sentinel from
        # `leaves`, so its parameters stay as they are).
        table_bytes = table_record_bytes(pg)
        leaves = self.workspace(
            f"launch{i}.leaves",
            Formula.const(table_bytes),
            "the leaf table"
            + (" and its epilogue addresses" if pg.epilogue else "")
            + (" and its row numbers (index tensors)" if pg.index_maps else "")
            + (" and its output scale addresses" if pg.sd is not None else "")
            + (" and its copy addresses" if pg.c is not None else ""),
        )
        maps_ws = self.workspace(
            f"launch{i}.maps",
            Formula.const(len(maps) * x.leaf_count * TENSOR_MAP_BYTES),
            "the per-leaf tensor maps",
        )
        templates = self.map_templates(i, maps, maps_ws)
        operand = {"a": pg.a.tensor, "b": pg.b.tensor, "d": pg.d.tensor}
        # A builder that runs the offsets check takes the check's parameters in place of
        # its own tensors (it reads the copies it checks, and the index tensors).
        table_params = [
            Param("leaves", "GsLeaf*", leaves),
            Param("maps", "GsTensorMap*", maps_ws),
            Param("templates", "const GsTensorMap*", templates),
            *(Param(op.upper(), "const void*", self.where[operand[op]]) for op in TABLE_OPERANDS),
            # A SwiGLU's up weight (B itself for stacked halves): the builder writes its map.
            *((Param("U", "const void*", self.where[pg.u.tensor]),) if pg.u is not None else ()),
            *self.table_operands(x),
        ]
        # Split K's counters are zeroed before the builder runs, not between it and the GEMM:
        # nothing comes between a programmatic GEMM and the builder it depends on.
        split = self.split_params(x)
        one = Formula.const(1)
        self.steps.append(
            KernelLaunch(
                "leaf_table", x.table_kernel, file, f"launch {i}", (one, one, one),
                TABLE_THREADS, 0, 1, tuple(table_params),
            )
        )
        gemm_params = (
            Param("leaves", "const GsLeaf*", leaves),
            Param("maps", "const GsTensorMap*", maps_ws),
            Param("num_leaves", "int", self.value(x.leaf_count)),
            *self.gemm_operands(x),
            *split,
        )
        grid = _persistent_grid(cfg)
        # A programmatic dependent of its builder (the step just before): its prologue
        # overlaps the builder, and it waits for the builder before it reads the table.
        self.steps.append(
            KernelLaunch(
                "gemm", cfg.name, file, f"launch {i}", grid, cfg.threads, cfg.smem_bytes,
                cfg.cluster, gemm_params, programmatic=cfg.programmatic,
            )
        )

    def map_templates(self, i: int, maps: tuple[MapTemplate, ...], maps_ws: Source) -> Source:
        """Launch i's tensor-map templates, uploaded encoded at the address of its maps."""
        templates = self.workspace(
            f"launch{i}.templates", Formula.const(len(maps) * TENSOR_MAP_BYTES), "the tensor-map templates"
        )
        self.steps.append(Upload(templates.ref, templates=maps, address_of=maps_ws.ref))
        return templates

    def gemm_operands(self, x: EmittedLaunch) -> list[Param]:
        """A GEMM's operands and scales, in both kinds of launch."""
        cfg, pg, null = x.gemm, x.launch.problems, Source("null")
        return [
            Param("A", _ptr(cfg.a_type), self.where[pg.a.tensor]),
            Param("B", _ptr(cfg.b_type), self.where[pg.b.tensor]),
            Param("D", _ptr(cfg.d_type, const=False), self.where[pg.d.tensor]),
            Param("SA", "const float*", self.where[pg.sa.tensor] if pg.sa else null),
            Param("SB", "const float*", self.where[pg.sb.tensor] if pg.sb else null),
        ] + (
            [  # a SwiGLU's up rows and their scales (B's and SB for stacked halves)
                Param("U", _ptr(cfg.b_type), self.where[pg.u.tensor]),
                Param("SU", "const float*", self.where[pg.su.tensor] if pg.su else null),
            ]
            if pg.u is not None else []
        )

    def split_params(self, x: EmittedLaunch) -> list[Param]:
        """A split-K GEMM's arrival counters (uploaded as zeros; each launch leaves them at
        zero) and partial sums, its last two parameters."""
        i, cfg = x.launch.index, x.gemm
        if not cfg.split_k:
            return []
        counters = self.workspace(
            f"launch{i}.split_counters", Formula.const(4 * cfg.split_counters), "split K's arrival counters"
        )
        self.steps.append(Upload(counters.ref, int32=(Formula.const(0),) * cfg.split_counters))
        sums = self.workspace(
            f"launch{i}.split_sums", Formula.const(cfg.split_sums_bytes), "split K's partial sums"
        )
        return [Param("split_counters", "int*", counters), Param("split_sums", "float*", sums)]

    def table_operands(self, x: EmittedLaunch) -> list[Param]:
        """The builder's run-time inputs after its operands: the check's parameters (or the
        offsets tensors), the run-time dims, then the fused epilogue's operands, an FP8
        D's scales and D's copy with its scales."""
        pg = x.launch.problems
        tensors = (
            self.check_params if x.check is not None
            else tuple(Param(f"p_{t}", "const int*", self.where[t]) for t in x.table_params)
        )
        params = [*tensors, *(Param(f"dim_{d}", "long long", Source("dim", d)) for d in x.dim_params)]
        if pg.epilogue:
            by_kind = {e.kind: e for e in pg.epilogue}
            null = Source("null")
            for kind, pname in (("alpha", "ALPHA"), ("row", "ROW"), ("bias", "BIAS")):
                e = by_kind.get(kind)
                params.append(Param(pname, "const void*", self.where[e.tensor] if e else null))
        if pg.sd is not None:
            params.append(Param("SD", "float*", self.where[pg.sd.tensor]))
        if pg.c is not None and pg.sc is not None:
            params.append(Param("C", "void*", self.where[pg.c.tensor]))
            params.append(Param("SC", "float*", self.where[pg.sc.tensor]))
        return params

    def inline_launch(self, x: EmittedLaunch, file: str, maps: tuple[MapTemplate, ...]) -> None:
        """A GEMM that builds its leaf table itself: one kernel, with the builder's inputs
        after its own, and map slots for each of its blocks."""
        i, cfg = x.launch.index, x.gemm
        leaf_maps = 2 + (cfg.consumer_warpgroups if cfg.store_tma else 0)
        whole = 2 if cfg.whole_maps else 0  # each block's maps of A's and B's whole buffers, after those
        maps_ws = self.workspace(
            f"launch{i}.maps",
            Formula.const(INLINE_MAX_BLOCKS * (x.leaf_count * leaf_maps + whole) * TENSOR_MAP_BYTES),
            "each block's tensor maps of the leaves it computes" + (" and of A's and B's whole buffers" if whole else ""),
        )
        templates = self.map_templates(i, maps, maps_ws)
        params = (
            Param("maps", "GsTensorMap*", maps_ws),
            Param("templates", "const GsTensorMap*", templates),
            *self.gemm_operands(x),
            *self.table_operands(x),
            *self.split_params(x),
        )
        self.steps.append(
            KernelLaunch(
                "gemm", cfg.name, file, f"launch {i}", _persistent_grid(cfg), cfg.threads, cfg.smem_bytes,
                cfg.cluster, params,
            )
        )


def _persistent_grid(cfg: GemmKernelConfig) -> tuple[Formula, Formula, Formula]:
    """A GEMM's persistent grid: one block per multiprocessor (two for memory-bound tiles),
    whole clusters only."""
    one = Formula.const(1)
    return ((Formula.var(NUM_SMS) * cfg.ctas_per_sm // cfg.cluster).max(1) * cfg.cluster, one, one)


def launch_manifest(spec: Spec, program: EmittedProgram, stem: str | None = None) -> Manifest:
    """The manifest of one emitted spec; `stem` names its files (default: file_stem)."""
    b = _Builder(spec, program, stem or file_stem(spec.name))
    check = None
    if program.check is not None:
        b.offsets_check(program.check)
        v = program.check.kernel
        first = program.launches[0] if program.launches else None
        symbol = (
            v.name if not program.check.fused
            else first.gemm.name if first is not None and first.gemm.inline_table  # its blocks check
            else first.table_kernel
        )
        check = OffsetsCheck(symbol, program.check.fused, v.checks)
    for kind, i, x in program.steps():
        if kind == "prepass":
            b.prepass(i, x)
        elif kind == "launch":
            b.launch(x)
        else:
            b.postpass(i, x)
    return Manifest(
        spec.name, spec.path, b.stem, spec.runtime_dims, spec_arguments(spec),
        tuple(b.workspaces), tuple(b.steps), check,
    )


def decode_file(stem: str, launch: int) -> str:
    """The file of a launch's decode variant: the compiled file's name, tagged."""
    return f"{stem}_launch{launch}_decode.cu"


def with_decode_choice(spec: Spec, manifest: Manifest, variant: DecodeVariant) -> Manifest:
    """`manifest` with the decode variant a call may take instead (DecodeChoice). The
    variant's manifest is built as any other; its changed launches' kernels then move to
    files of their own, since the variant's sources have the compiled file names."""
    decode = launch_manifest(spec, variant.program, manifest.stem)
    changed_launches = {i for i, _, _ in variant.launches}
    files: dict[str, str] = {}
    steps: list[Step] = []
    for s in decode.steps:
        if isinstance(s, KernelLaunch) and s.owner.startswith("launch "):
            i = int(s.owner.split()[1])
            if i in changed_launches:
                # The sources are keyed by the spec's name; file names use the stem.
                assert s.file.startswith(manifest.stem)
                files[decode_file(manifest.stem, i)] = variant.program.spec + s.file[len(manifest.stem) :]
                s = replace(s, file=decode_file(manifest.stem, i))
        steps.append(s)
    choice = DecodeChoice(variant.rule, variant.launches, files, decode.workspaces, tuple(steps))
    return replace(manifest, decode=choice)
