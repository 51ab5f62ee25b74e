"""The tile heuristic: what each launch gets, and why (explain prints the reason)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gemmspec
from gemmspec.tiling import candidate_widths, choose_tile

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    "n, m_bound, scaled, sb_bn, want, pairs",
    [
        # FP8 1x128/128x128: 192 columns straddle at most one B scale block boundary
        # (two scales per tile) and move the fewest bytes; CTA pairs along M share B.
        ([4096], None, True, 128, (128, 192), True),
        # BF16: the widest tile moves the fewest bytes per output.
        ([4096], None, False, 1, (128, 256), False),
        # Per-column B scales (WGRAD 128x1): at most 128 columns.
        ([7168], None, True, 1, (128, 128), True),
        # A skinny memory-bound GEMM: 64-row tiles, 16 columns, an odd column-block count.
        ([16], None, False, 1, (64, 16), False),
        # Leaves of at most 64 rows (masked M = 64): blockwise FP8 streams its weights, 256
        # columns where N is a multiple of 256, else the cheapest scaled width.
        ([4096], 64, True, 128, (64, 256), False),
        ([7168, 2048], 64, True, 128, (64, 256), False),
        ([1408], 64, True, 128, (64, 160), False),
        ([384], 64, True, 128, (64, 192), False),
        # Per-column B scales keep their widths.
        ([4096], 64, True, 1, (64, 128), False),
        # Leaves of at most 128 rows: a pair's second CTA would have no rows.
        ([4096], 128, True, 128, (128, 192), False),
        # N known only at run time: the widest candidate.
        ([None], None, False, 1, (128, 256), False),
        # 200 columns: two 128-wide blocks beat four 64-wide ones.
        ([200], None, True, 128, (128, 128), True),
        # 136 columns, unscaled: one 192-wide block.
        ([136], None, False, 1, (128, 192), False),
    ],
)
def test_choose_tile(n, m_bound, scaled, sb_bn, want, pairs):
    t = choose_tile(n, m_bound, scaled, sb_bn)
    assert (t.tile_m, t.tile_n) == want, t.reason
    assert t.pair_rows == pairs
    assert ("CTA pairs along M" in t.reason) == pairs and ("one CTA per tile" in t.reason) != pairs


@pytest.mark.parametrize("why, kwargs", [
    ("masked rows: pairs measured slower", {"masked": True}),
    ("A's rows are gathered row by row", {"gather": True}),
])
def test_blockwise_fp8_tiles_not_paired(why, kwargs):
    t = choose_tile([4096], 1024 if kwargs.get("masked") else None, True, 128, **kwargs)
    assert not t.pair_rows and why in t.reason
    # A bias, an FP8 output and a SwiGLU keep one CTA per tile too (not measured in pairs).
    for other in ({"bias": True}, {"fp8_out": True}, {"swiglu": True}):
        assert not choose_tile([4096], None, True, 128, **other).pair_rows
    # Per-channel scales run the unscaled main loop: no pairs.
    assert not choose_tile([4096], None, True, 1, per_channel=True).pair_rows


def test_scaled_widths_straddle_at_most_one_b_scale_boundary():
    assert candidate_widths(True, 128) == (192, 160, 144, 128, 96, 64, 48, 32, 16)
    # 64-column B blocks: 128 and 96 columns touch two blocks, 192 would touch three.
    assert 192 not in candidate_widths(True, 64) and 96 in candidate_widths(True, 64)
    assert all(w <= 192 and w % 8 == 0 for w in candidate_widths(True, 1))
    assert max(candidate_widths(False, 1)) == 256


def test_explain_states_the_tile_choice_and_loader():
    text = gemmspec.build(EXAMPLES / "moe_fp8_forward.gspec").explain()
    assert "tile choice: 128-row tiles, 192 columns" in text
    assert "CTA pairs along M that multicast their B tile" in text
    assert "loads: TMA through a tensor map per leaf and operand" in text
    wgrad = gemmspec.build(EXAMPLES / "moe_fp8_wgrad.gspec").explain()
    assert "are stored with padded segments (segment_major pad 16)" in wgrad
    assert "so every leaf loads by TMA whatever its length" in wgrad
    unpadded = gemmspec.build((EXAMPLES / "moe_fp8_wgrad.gspec").read_text().replace(" pad 16", "")).explain()
    assert "segments whose length is not a multiple of 16 bytes take that path" in unpadded
    assert "padded segments" not in unpadded


def test_explain_names_the_emitted_kernel_and_its_configuration():
    exe = gemmspec.build(EXAMPLES / "moe_fp8_forward.gspec")
    (launch,) = exe.program.launches
    text = exe.explain()
    assert f"kernel {launch.gemm.name} (128x192 tiles, {launch.gemm.stages} stages" in text
    assert (
        "output staged and stored by TMA where a leaf's rows end on 16-byte boundaries (else from registers, masked "
        "per element), two B scales per tile and K block, staged by the producer as SA x SB "
        "products, K loop in rounds "
        f"of {launch.gemm.stages} blocks with their stages fixed at compile time)"
    ) in text
    wgrad = gemmspec.build(EXAMPLES / "moe_fp8_wgrad.gspec").explain()
    assert "a B scale per column and K block, staged by the producer, K loop in rounds of" in wgrad
    # A BF16 += through the staging: the old tile comes in by TMA.
    expand = gemmspec.build(EXAMPLES / "lora_moe_scaled.gspec").explain()
    assert "old output tile loaded into the staging by TMA, added to and stored by TMA" in expand


def test_tile_directive_pins_the_tile():
    spec = (EXAMPLES / "moe_fp8_forward.gspec").read_text().rstrip().rstrip("}") + "  tile(64, 64)\n}\n"
    exe = gemmspec.build(spec)
    (launch,) = exe.program.launches
    assert (launch.gemm.tile_m, launch.gemm.tile_n, launch.gemm.cluster) == (64, 64, 1)


@pytest.mark.parametrize("scaled, sb_bn", [(False, 1), (True, 128), (True, 1)])
@pytest.mark.parametrize("n", [[None], [2816], [48], [7168]])
def test_swiglu_tiles_hold_whole_gate_up_pairs(n, scaled, sb_bn):
    # Tiles start at multiples of their width, so an even width never splits a pair.
    assert choose_tile(n, None, scaled, sb_bn, swiglu=True).tile_n % 2 == 0
