"""requantize(SOURCE, rows = IDX, weight = W) as emitted: the requant kernel behind two
compile-time switches (the existing requant kernels' code unchanged, byte for byte), its
manifest step (the index, the source's row count and the weight after the old
parameters), and every switch combination compiled for sm_90a without spills."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from gemmspec.codegen.emit import emit
from gemmspec.codegen.kernels import (
    RequantKernelConfig,
    include_dir,
    render_requant,
    render_transpose,
)
from gemmspec.codegen.manifest import launch_manifest
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

# sha256 of render_requant / render_transpose for the configurations that existed before
# the rows and weight switches: the emitted code of those kernels must not move unless on
# purpose (last: the scale rule called from the device header, gs_fp8_scale, the same SASS;
# before that the scale of a block whose amax / FP8 max underflows is 1, as an all-zero
# block's, not 0; before that version 3.20, the transposed stores four tokens at a time).
PINNED = {
    (1, "e4m3", "e4m3"): "e478fb0c7210e2d40f9f9a203772b28b336127979be3ae0f69cfeec41fe1358d",
    (1, "e4m3", "e5m2"): "3b3d4e785775a7121071a0dd22b1311c67a6d926c66c2463d4aa4096bb0c9ffa",
    (1, "e5m2", "e4m3"): "6bf5031cda0067d3e05bbc89d3f93c564cabc2e5004048d5f806fba782464c56",
    (1, "e5m2", "e5m2"): "326b396dc71b3993da2fb429cc2fa0fa7a521a4a561c7697f2b940fac6d94644",
    (16, "e4m3", "e4m3"): "0d38f2c34fefeb5610c60b02d7f898ca3c582cb69036d45dafabae7636ca6723",
    (16, "e4m3", "e5m2"): "be40893e72ced6f5c88cb61c36ba8fe984de0f26bf9a8a3c58a0a5d59f71e5eb",
    (16, "e5m2", "e4m3"): "72bbc925b2b6110dbbc818244c3b93e4cda2cbe85431815f07f9ce78e3d1ddf1",
    (16, "e5m2", "e5m2"): "52f922daf53a720fc029f05aa33f72bf0d47a6ee1b4c357556a64e4bd1aba827",
}
TRANSPOSE_SHA = "8a4774110b5216a1789c133ea36b0bda6f522f2e8e01fcf15214378b5cfa4bbe"

SPEC = """\
gemm wgrad_rows {
  dim T, S
  dim N = 264, K = 576
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dst : i32 [T]
  tensor rw  : f32 [T]
  tensor dy  : e4m3 [{src_rows}, N] scale f32 [1, 128]
  tensor x_t : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy{opts})
  tensor dw  : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_t[t, k]
}
"""
OPTIONS = {
    "rows_weight": ", rows = dst, weight = rw",
    "rows": ", rows = dst",
    "weight": ", weight = rw",
}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("key", sorted(PINNED), ids=lambda k: "_".join(map(str, k)))
def test_existing_requant_kernels_render_byte_for_byte_as_before(key):
    pad, i, o = key
    assert _sha(render_requant(RequantKernelConfig(in_type=i, out_type=o, pad=pad))) == PINNED[key]


def test_the_transpose_beside_it_renders_as_before():
    assert _sha(render_transpose()) == TRANSPOSE_SHA


def test_the_switches_name_the_kernel_and_add_only_their_code():
    plain = render_requant(RequantKernelConfig(pad=16))
    both = RequantKernelConfig(pad=16, gather_rows=True, row_weight=True)
    assert both.name.endswith("_p16_rows_rw")
    assert RequantKernelConfig(gather_rows=True).name.endswith("_w256_rows")
    assert RequantKernelConfig(row_weight=True).name.endswith("_w256_rw")
    src = render_requant(both)
    assert "const int* __restrict__ idx, int S, const float* __restrict__ W) {" in src
    assert "src_row[r]" in src and "__ldg(W + t0 + r)" in src
    assert "idx" not in plain.replace("bid", "") and "W + t0" not in plain
    weight_only = render_requant(RequantKernelConfig(row_weight=True))
    assert "src_row" not in weight_only and "__ldg(W + t0 + r)" in weight_only


def program(opts: str):
    # Without rows the source has the target's rows.
    text = SPEC.replace("{opts}", opts).replace("{src_rows}", "S" if "rows" in opts else "T")
    (low,) = lower_file(text)
    return low, emit(low.spec, low.schedule)


@pytest.mark.parametrize("key", sorted(OPTIONS))
def test_the_prepass_and_its_manifest_step(key):
    low, prog = program(OPTIONS[key])
    (p,) = prog.prepasses
    rows, weight = "rows" in key, "weight" in key
    assert p.config.gather_rows == rows and p.config.row_weight == weight
    assert p.config.pad == 16
    assert (p.prepass.index, p.prepass.weight) == ("dst" if rows else None, "rw" if weight else None)
    manifest = launch_manifest(low.spec, prog)
    step = next(s for s in manifest.steps if getattr(s, "role", None) == "requantize")
    names = [q.name for q in step.params]
    base = ["X", "ldx", "SX", "sx_st", "sx_sc", "offsets", "G", "T", "C", "Y", "SY"]
    assert names == base + (["idx", "S"] if rows else []) + (["W"] if weight else [])
    by_name = {q.name: q for q in step.params}
    if rows:
        assert by_name["idx"].source.ref == "dst"
    if weight:
        assert by_name["W"].source.ref == "rw"
    # The offsets check reads the index over the target's rows, bounded by the source's:
    # an entry outside them reads a zero row in the pass and fails `check=True`.
    from gemmspec.codegen.validate import IndexRows, index_rows

    assert index_rows(low.spec) == ((IndexRows("dst", "T", "S", ("dy",), None),) if rows else ())
    if rows:
        assert "index_dst" in [q.name for q in prog.check.kernel.params]
    # The target (and its workspace) has the statement's rows, T, not the source's S.
    ws = manifest.workspace("prepass0.dy_q")
    assert ws.bytes.evaluate({"T": 1000, "S": 7 if rows else 1000}) == (1000 + 4 * 15) * 264


def test_the_explain_text_names_rows_and_weight():
    low, _ = program(OPTIONS["rows_weight"])
    text = str(low.schedule)
    assert "pre-pass: dy_q = requantize(dy, rows = dst, weight = rw) before launch 0" in text
    assert "rows through dst -> dy_q" in text and "row t times rw[t]" in text


CONFIGS = {
    f"{'rows' if r else 'norows'}_{'w' if w else 'now'}_p{p}": RequantKernelConfig(pad=p, gather_rows=r, row_weight=w)
    for r in (False, True)
    for w in (False, True)
    for p in (1, 16)
    if r or w
}


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_the_switched_kernels_compile_spill_free(key):
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import spill_free_sass

    cfg = CONFIGS[key]
    sass = spill_free_sass(render_requant(cfg), [include_dir()], f"{cfg.name}.cu")
    assert cfg.name in sass


# ---- the derived backward of the training FFN example -----------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8_train.gspec"


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["auto", "fused"])
def test_every_kernel_of_the_example_backward_compiles_spill_free(gather):
    """The backward of examples/moe_ffn_fp8_train.gspec (DGRAD with gathered dy rows before
    route_w, WGRAD over requantize(dy, rows = dst, weight = route_w) and the forward's h_t,
    the row passes, and the SwiGLU up-projection's backward): every emitted source compiles
    for sm_90a without spills,
    with the DGRAD's rows copied by the gather pre-pass (as planned) or gathered in its
    loads."""
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import spill_free_sass

    from gemmspec.backward import derive_backward
    from gemmspec.bench import with_directive
    from gemmspec.build import build

    source = derive_backward(build(EXAMPLE).spec).source
    exe = build(source if gather == "auto" else with_directive(source, f"gather({gather})"))
    dgrad = exe.program.launches[0].gemm
    assert dgrad.gather == (gather == "fused") and dgrad.epilogue == ()
    sources = exe.program.sources()
    requant = [p for p in exe.program.prepasses if p.prepass.kind == "requantize"]
    # dy's rows weighted for the down WGRAD; x's rows (gathered through src) for the up WGRAD.
    assert [(p.prepass.source, p.config.gather_rows, p.config.row_weight, p.config.pad) for p in requant] == [
        ("dy", True, True, 16), ("x", True, False, 16),
    ]
    for name, source in sources.items():
        spill_free_sass(source, [include_dir()], name)


def test_every_source_of_the_rows_spec_compiles():
    """The pass, its offsets check (reading the index) and the WGRAD."""
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import spill_free_sass

    _, prog = program(OPTIONS["rows_weight"])
    sources = prog.sources()
    assert any(name.endswith("_check.cu") for name in sources)
    for name, source in sources.items():
        spill_free_sass(source, [include_dir()], name)
