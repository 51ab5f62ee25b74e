"""Kernel configurations and CUDA source rendering for Hopper (sm_90a).

Each config is a frozen value that fixes everything a kernel bakes in at compile
time; the Jinja2 templates under ``templates/`` only lay those values out as C++
(``grouped_gemm.cu.jinja``; ``requant.cu.jinja`` holds both FP8-in pre-passes,
``quantize.cu.jinja`` the one that quantizes a bf16/f16/f32 source).
Names are procedural and deterministic so that equal configs render equal source
(and hit the same cubin cache entry).

This module must not import lark (the GPU harness runs where lark is missing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from jinja2 import Environment, PackageLoader, StrictUndefined

from ..lower.schedule import cluster_suffix
from .wgmma import wgmma_struct

# Element types the kernels understand, with their C++ spellings (CUDA toolkit headers).
CTYPES: dict[str, str] = {
    "e4m3": "__nv_fp8_e4m3",
    "e5m2": "__nv_fp8_e5m2",
    "bf16": "__nv_bfloat16",
    "f16": "__half",
    "f32": "float",
    "i32": "int",  # index tensors
}
ELEMENT_BYTES: dict[str, int] = {"e4m3": 1, "e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "i32": 4}
FP8_TYPES = frozenset({"e4m3", "e5m2"})
EPILOGUE_KINDS = ("alpha", "row", "bias")  # the order the epilogue applies them
OPERAND_TYPES = frozenset({"e4m3", "e5m2", "bf16", "f16"})
OUTPUT_TYPES = frozenset({"bf16", "f16", "f32"})
SWIGLU_OUTPUT_TYPES = ("bf16", "f32", "e4m3", "e5m2")  # FP8: quantized in the epilogue
# An FP8 output is quantized in the epilogue, one f32 scale per row and this many columns.
D_SCALE_COLS = 128
# A copy's staging: one row of this many bytes per column of D (128 rows and 16 bytes of
# padding, so that the columns of one warp's byte stores fall in different banks).
COPY_COL_PITCH = 144
# Largest finite value of each FP8 format: the quantization target of a requant pass.
FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}


def fp8_max_exponent(dtype: str) -> int:
    """E with FP8_MAX = 1.75 * 2^E (both formats' largest value has the significand 1.75):
    448 = 1.75 * 2^8, 57344 = 1.75 * 2^15. Power-of-two scales are found from it."""
    mantissa, exponent = math.frexp(FP8_MAX[dtype])
    assert mantissa == 0.875, dtype
    return exponent - 1
FP8_INTERP: dict[str, str] = {"e4m3": "__NV_E4M3", "e5m2": "__NV_E5M2"}
QUANTIZE_IN_TYPES = frozenset({"bf16", "f16", "f32"})
QUANTIZE_PER_LANE = 4  # elements per lane of a quantize warp: 32 lanes span a 128 block
# One vector load per lane: 4 elements of 2 or 4 bytes.
QUANTIZE_VECTOR = {2: "uint2", 4: "uint4"}
# One swizzle row is 128 bytes: shared-memory tiles are built from these atoms.
SWIZZLE_BYTES = 128
SMEM_ALIGN = 1024


def _ctype(dtype: str) -> str:
    try:
        return CTYPES[dtype]
    except KeyError:
        raise ValueError(f"no C++ spelling for dtype {dtype!r}") from None


def _cbool(flag: bool) -> str:
    return "true" if flag else "false"


ENV = Environment(
    loader=PackageLoader("gemmspec.codegen", "templates"),
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
    keep_trailing_newline=True,
)
ENV.filters["ctype"] = _ctype
ENV.filters["cbool"] = _cbool


def include_dir() -> str:
    """Directory holding gemmspec_ptx.cuh (add it to the NVRTC include path)."""
    return str(Path(__file__).resolve().parent / "include")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# Shared memory one block may use on Hopper (227 KB), and the deepest ring worth having.
SMEM_LIMIT = 232448
# Shared memory of one multiprocessor, and what the hardware reserves per resident block:
# two blocks per SM get (SM_SMEM / 2 - SMEM_RESERVED_PER_CTA) each.
SM_SMEM = 233472
SMEM_RESERVED_PER_CTA = 1024
# A table built in the kernel (``inline_table``): its region's alignment slack, the static
# shared memory a check with anchored scale rows adds (its counter: ptxas places the
# 1024-byte aligned dynamic array after it, so it takes a whole 1 KB), the most blocks
# that get map slots and the most leaves such a table holds.
INLINE_ROUNDING = 128
INLINE_STATIC_BYTES = 1024
INLINE_MAX_BLOCKS = 320
INLINE_MAX_LEAVES = 32
MAX_STAGES = 12
# The most K blocks of a first tile's weights that its L2 prefetch asks for (see
# prefetch_k_blocks): 16 blocks of 128 bytes per row, 512 KB per 256-row tile, 68 MB over
# 132 blocks, already more than L2 holds.
MAX_PREFETCH_K_BLOCKS = 16
# Swizzle rows of K a ring stage may hold (tile_k / its one-row value).
K_ATOMS = (1, 2, 4)
# A staged epilogue is worth its shared memory only while the ring stays this deep.
MIN_STAGES_WITH_STAGING = 3
# Columns of one wgmma batch when a blockwise tile runs its K block in parts (mma_parts).
MMA_PART_N = 128
# Registers per thread after reallocation: the producer warpgroup gives its registers to
# the consumers (3 warpgroups: 128 * 56 + 256 * 224 <= 65536).
PRODUCER_REGS = 56
CONSUMER_REGS = 224
# Split K: the split tiles' K blocks are dealt evenly to at most the blocks of a persistent
# grid on SPLIT_MAX_SMS multiprocessors (every Hopper part has at most 132; 160 blocks of
# two per SM are INLINE_MAX_BLOCKS, the most that get map slots when the table is built in
# the kernel). Each block has two slots of partial sums (the split tiles its run starts and
# ends in) and one arrival counter per consumer warpgroup (for the tile its run ends in).
SPLIT_MAX_SMS = 160
# The block's split plan and run, in shared memory after the mbarriers.
SPLIT_WORK_BYTES = 64


@dataclass(frozen=True)
class GemmKernelConfig:
    """Everything a grouped GEMM kernel fixes at compile time.

    ``tile_k`` 0 means "one 128-byte swizzle row of K" (128 for FP8, 64 for 16-bit) per
    ring stage; unscaled kernels of one CTA per tile may take 2 or 4 swizzle rows (each
    stage then loads as many TMA boxes per operand, and each barrier round trip moves
    that many times the bytes: what a memory-bound stream needs, see ``k_atoms``);
    ``mma_lag`` is how many earlier K blocks' wgmma batches the unscaled main loop leaves
    running when it issues one (their stages are released that much later);
    ``stages`` 0 means as many ring stages as shared memory holds (at most MAX_STAGES);
    ``store_tma`` None means "stage the epilogue in shared memory and store it by TMA
    when the tile allows it and the ring keeps at least MIN_STAGES_WITH_STAGING stages";
    ``consumer_scales`` None means "the producer stages every stage's scales in shared
    memory" (True: the consumers read SA and SB from global memory, a K block ahead, which
    only tiles needing at most two B scales allow; measured 5 % slower on the H200 once the
    staged loop runs in rounds, see ``ring_rounds``);
    ``prefetch_scales`` None means "consumers load the next K block's scales while this
    one's MMAs run" unless a fused bias and a wide tile leave no registers for them;
    ``lean_registers`` None means "keep the ring's wgmma descriptors and barrier addresses
    in registers across the tile" unless a fused bias and a wide tile leave no registers
    for them (then each descriptor is rebuilt from the shared address per instruction);
    ``ctas_per_sm`` 0 means "two resident blocks per multiprocessor for a memory-bound
    tile (64 rows, at most 32 columns: one consumer warpgroup that mostly waits on loads),
    one otherwise"; the ring then gets half the shared memory and the grid twice the blocks;
    ``name`` "" means the procedural name. Unscaled configs normalise the scale block
    sizes to 1 so that equal kernels compare (and hash) equal.

    ``gather``: A's rows are read through an index tensor (each leaf's row numbers in its
    GsGather record): the producer loads them by TMA a row at a time (``gather_tma``) or
    copies them with 16-byte cp.async copies, and stages their scales itself (``consumer_scales`` False), one CTA per tile (``cluster`` 1: there
    is no A tile to multicast). ``scatter``: D's rows are written through an index tensor,
    from registers (``store_tma`` False), with `=` only.

    ``programmatic``: the kernel waits (``griddepcontrol.wait``) after its prologue, before
    it reads the leaf table, a tensor map or an operand and before any store, so it can be
    launched as a programmatic dependent of its leaf-table builder (the launch attribute
    is the launcher's; without it the wait does nothing). False leaves the wait out
    (``_nopdl`` in the name) and the manifest launches it the ordinary way.

    ``sa_bk == sb_bk == 0`` (scaled) means one scale along the whole of K: per-channel
    scales. Such a kernel runs the unscaled main loop (no scales staged) and multiplies the
    finished accumulators by SA(row) * SB(column) before the epilogue. With FP8 operands
    that loop still adds each 128-wide K block's products into the f32 result from a fresh
    accumulator (``promotes``), unless ``fast_accum`` keeps the whole of K in the tensor
    cores' accumulator (about 14 bits of mantissa; ``_fastacc`` in the name).
    """

    a_type: str
    b_type: str
    d_type: str
    accumulate: bool = False
    scaled: bool = False
    sa_bm: int = 1
    sa_bk: int = 128
    sb_bn: int = 128
    sb_bk: int = 128
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 0
    mma_lag: int = 1
    # FP8 without scales per K block: one accumulator over the whole of K (the language's
    # `accumulate(fast)`), instead of a promotion into f32 every 128 of K.
    fast_accum: bool = False
    stages: int = 0
    raster: int = 8
    cluster: int = 1
    # A pair (cluster 2) takes neighbouring row blocks and multicasts B, not neighbouring
    # column blocks multicasting A (``c2b`` in the name).
    multicast_b: bool = False
    # Consumer warpgroups per 64 rows, each taking an equal share of the tile's columns
    # (2: a 64 x 256 blockwise tile as two warpgroups of 64 x 128, each in one B scale
    # block). One warpgroup runs its K block's two 128-column batches one after the other,
    # each waited for and promoted before the next; two run theirs side by side, so a
    # 64-row tile's K block takes about half as long where the tensor cores are not the
    # bound (decode: a few rows per expert). ``_w384`` in the name of a 64-row tile.
    n_split: int = 1
    store_tma: bool | None = None
    consumer_scales: bool | None = None
    prefetch_scales: bool | None = None
    # L2 eviction policies on the TMA loads (A evict-first, B evict-last); default: for
    # memory-bound tiles, which stream A once while B stays to be read again.
    cache_hints: bool | None = None
    # B's TMA loads evict first in L2 (A's keep no policy): weights read once per call (a
    # decode step's experts) then leave what L2 already holds in place, dirty lines among
    # it, instead of evicting it and making HBM take their write-back while the weights
    # stream in. Not with cache_hints (which keeps B) or a pair's multicast loads.
    b_evict_first: bool = False
    lean_registers: bool | None = None
    ctas_per_sm: int = 0
    name: str = ""
    # Fused epilogue operands, (kind, element type) in EPILOGUE_KINDS order: "alpha" (a
    # per-leaf scalar), "row" (a per-row weight), "bias" (a per-column bias).
    epilogue: tuple[tuple[str, str], ...] = ()
    # SwiGLU: tile columns 2j (gate) and 2j + 1 (up) become D's column j, silu(gate) * up,
    # before the epilogue operands; D is addressed by its own (half as many) columns.
    swiglu: bool = False
    # A SwiGLU over gate and up rows not interleaved: a tile's B rows are the gate rows of
    # D's columns n0/2 .., loaded from B, then the same up rows, from the up weight U (B
    # itself ``swiglu_up_rows`` rows on); a third tensor map per leaf, U and its scales SU
    # as kernel parameters (U shares B's per-leaf offsets and strides).
    swiglu_halves: bool = False
    swiglu_up_rows: int = 0
    # Rows through index tensors: A's gathered, D's scattered.
    gather: bool = False
    scatter: bool = False
    # A gathered A loaded by TMA, one box of one row per tile row (each producer thread
    # issues its row's box at the row number its index gives), where the leaf's A is one
    # TMA can describe; else copied by hand. The emitter sets it for every gathered A (11 %
    # faster than copying on the H200); False copies every leaf (the probe's variant).
    gather_tma: bool = False
    programmatic: bool = True
    # The scaled main loop runs rounds of ``stages`` K blocks from ring stage 0, unrolled,
    # with every block's ring stage a compile-time constant (fixed barrier addresses,
    # descriptors and scale slots); the blocks before the ring comes back to stage 0 and
    # after the tile's last whole round go one at a time, the stage in a register. None: rounds where the producer
    # stages the scales (+3-5 % on the H200) and no fused epilogue operands crowd the
    # registers (ptxas spills); not where the
    # consumers load them a block ahead (ptxas then schedules those loads late: -15 %).
    # The name says the non-default.
    ring_rounds: bool | None = None
    # Producer-staged scales read right after the stage's full barrier, before the K block's
    # wgmma issue (DeepGEMM's order), instead of after it. None: before it where B's scales
    # change per column (SB mode 2, the WGRAD): read after it, ptxas placed the shared loads
    # between the K block's first and second wgmma, and the 96 SA x SB products there waited
    # on them, holding up the other three's issue (kernel probe on the H200: 805-812
    # against 774-784 TFLOPS, +3-4 %); after it elsewhere (one or two B scales: 1131
    # against 1123-1125, within drift). The name says the non-default (``_earlyscales`` /
    # ``_latescales``).
    scales_before_issue: bool | None = None
    # The producer stages each tile row's SA x SB products (one per B scale of the tile)
    # instead of the raw scales, loading them into registers a K block ahead and storing
    # the products before its arrival on the stage's full barrier; the consumers read
    # products and multiply nothing before the promotion. Read as scales, ptxas put the
    # consumers' four products between a K block's first and second wgmma, where they
    # waited on the shared loads and held up the rest of the issue (kernel probe on the
    # H200, outputs identical: 1143.5 against 1130.7-1131.4 TFLOPS on 8 x 4096, 1156.2
    # against 1130.1-1130.6 on 4 x 8192). Possible (and the default, None) with one or two
    # B scales per tile (SB mode 0 or 1), one wgmma batch per K block and rows not
    # gathered; False elsewhere. The name says the non-default (``_rawscales``).
    staged_products: bool | None = None
    # An FP8 D (``d_type`` e4m3 or e5m2): the epilogue rounds the result to bf16 and
    # quantizes it as the quantize pass does, one f32 scale per row and D_SCALE_COLS
    # columns of D (a GsDScale record per leaf says where). ``d_scale_pow2``: the scales
    # are powers of two, as quantize(SOURCE, pow2) writes them.
    d_scale_pow2: bool = False
    # `T = copy(D)` of an FP8 D: the epilogue also writes D's copy segment-major (each
    # leaf's rows contiguous per column) with one f32 scale per column and 128 rows of the
    # leaf (a 128-row tile is one block), from the same bf16 values (a GsCopy record per
    # leaf says where). ``copy_pow2``: those scales are powers of two.
    copy: bool = False
    copy_pow2: bool = False
    # Split K for main loops whose leaves share one K (unscaled, or blockwise scales the
    # producer stages; the emitter's default for them). Memory-bound tiles: the tiles' K
    # blocks in a row, each block taking an equal run of them (whole tiles where they fill
    # the blocks); a tile shared by several blocks is added up by the last of them to finish,
    # in block order. Wider tiles: where the cost model says it pays at run time, the last
    # full wave and the tiles after it in 2-8 aligned parts of K, added up part by part in
    # the tile's slot. Either way the sums are taken in a fixed order (the same bits on
    # every call). ``_splitk`` in the name.
    split_k: bool = False
    # The leaf table built inside the kernel (``inline_table`` > 0: the bytes of its records
    # and of the checked offsets, which the emitter lays out): every block runs the offsets
    # check and builds the whole table in its shared memory before its first tile, and
    # writes the tensor maps of the leaves it computes into its own slots of the maps
    # workspace (INLINE_MAX_BLOCKS blocks at most), so a call is one launch with no
    # leaf-table builder before it. For launches of few leaves (at most INLINE_MAX_LEAVES)
    # and no rows through index tensors; the emitter decides. ``_inl``.
    inline_table: int = 0
    # With a table built in the kernel: A and B loaded through maps of their whole buffers
    # (one of each per block, written by the TMA issuer while the others build the table,
    # then released, acquired and prefetched by it while the consumer threads write the
    # leaves' own maps), a leaf's first rows becoming coordinates in them. Only D keeps a map
    # per leaf, whose stores end at the leaf's rows and columns (written by the consumers at
    # their start where they can: ``late_d_maps``); a leaf the whole maps do not describe
    # (see leaf_table.cu.jinja) keeps its own A and B maps. A box of a whole map reads the rows
    # after a leaf's last (the next leaf's, or zeros past the buffer) where a leaf's own map
    # reads zeros: those rows and columns of the tile are never stored. The emitter decides
    # (where both operands' row strides and the K extent are the same for every leaf and
    # every leaf starts at a whole row: emit.whole_maps_possible).
    # ``_whole``.
    whole_maps: bool = False
    # With whole maps and one CTA per tile (not the memory-bound tiles, whose split runs
    # start anywhere): once the table (and split K's plan) is built, the block's warps but
    # the whole maps' writer's prefetch into L2 `prefetch_k_blocks` K blocks of its first
    # unit's B rows from its first K block (a row per lane, `cp.async.bulk.prefetch`), so
    # HBM starts streaming the weights while the producer still waits for the whole maps
    # (about 1.5 us at decode sizes). Only a leaf in the whole maps: its rows lie in B's
    # buffer. ``_pf<n>``.
    prefetch_k_blocks: int = 0
    # A TMA-stored epilogue's CTA leaves once its last stores have read their staging
    # (`cp.async.bulk.wait_group.read`) rather than once their global writes are done: the
    # grid still completes only after them, but the last tile's CTA stops waiting for the
    # writes' acknowledgements (a decode call ends on its blocks' last epilogues). ``_xr``.
    exit_on_read: bool = False
    # Static shared memory of that table's check (a counter for anchored scale rows), which
    # ptxas places before the 1024-byte aligned dynamic array: 0 or INLINE_STATIC_BYTES.
    inline_static: int = 0

    def __post_init__(self) -> None:
        # Frozen: fill the derived defaults through object.__setattr__.
        if not self.scaled:
            for f in ("sa_bm", "sa_bk", "sb_bn", "sb_bk"):
                object.__setattr__(self, f, 1)
        if self.tile_k == 0 and self.a_type in ELEMENT_BYTES:
            object.__setattr__(self, "tile_k", self.atom_k)
        if self.ctas_per_sm == 0:
            object.__setattr__(self, "ctas_per_sm", 2 if self.memory_bound else 1)
        if self.split_k and not self.split_possible():
            raise ValueError(
                "split K takes unscaled main loops or blockwise scales the producer stages, one CTA "
                "per memory-bound tile, no staged 16-bit D += and no rows through index tensors or "
                "FP8 outputs"
            )
        if self.inline_table and (self.gather or self.scatter):
            raise ValueError("a table built in the kernel takes no index tensors")
        if self.inline_table:
            object.__setattr__(self, "programmatic", False)  # no builder to wait for
        if self.whole_maps and (not self.inline_table or self.swiglu_halves):
            raise ValueError("whole-tensor maps take a table built in the kernel and one B map per leaf")
        if self.prefetch_k_blocks and not (self.whole_maps and self.cluster == 1 and not self.memory_bound):
            raise ValueError("the first tile's L2 prefetch takes whole maps, one CTA per tile and no memory-bound tile")
        if not 0 <= self.prefetch_k_blocks <= MAX_PREFETCH_K_BLOCKS:
            raise ValueError(f"prefetch_k_blocks must be in [0, {MAX_PREFETCH_K_BLOCKS}]")
        if self.split_k and self.memory_bound and self.store_tma is None:
            object.__setattr__(self, "store_tma", False)  # the last unit of a tile stores it
        self._validate()
        if self.consumer_scales is None:
            # Gathered rows: the producer that copies them reads their scales too.
            object.__setattr__(self, "consumer_scales", False)
        elif self.consumer_scales and (not self.blockwise or self.sb_mode == 2):
            raise ValueError("consumers read scales only when a tile needs at most two B scales")
        elif self.consumer_scales and self.gather:
            raise ValueError("a gathered A's scales are staged by the producer, which reads its row numbers")
        if self.cache_hints is None:
            object.__setattr__(self, "cache_hints", self.memory_bound and self.cluster == 1)
        if self.b_evict_first and self.cache_hints:
            raise ValueError("B evicts first or stays in L2 (cache_hints), not both")
        if self.b_evict_first and self.cluster > 1:
            raise ValueError("a pair's multicast loads take no L2 policy (b_evict_first needs one CTA per tile)")
        if self.prefetch_scales is None:
            object.__setattr__(self, "prefetch_scales", self.consumer_scales and not self.bias_crowds_registers())
        elif not self.consumer_scales:
            # Only scales the consumers read can be loaded ahead; normalised so that
            # equal kernels compare equal.
            object.__setattr__(self, "prefetch_scales", False)
        if self.scales_before_issue is None or not self.smem_scales:
            # Only staged scales are read from the stage; normalised so equal kernels compare equal.
            object.__setattr__(self, "scales_before_issue", self.early_scales_by_default())
        if self.staged_products is None or not self.products_possible():
            object.__setattr__(self, "staged_products", self.products_possible())
        if self.ring_rounds is None:
            object.__setattr__(self, "ring_rounds", self.rounds_by_default())
        elif not self.blockwise:
            object.__setattr__(self, "ring_rounds", False)  # the unscaled loop has no rounds
        if self.lean_registers is None:
            object.__setattr__(self, "lean_registers", self.lean_by_default())
        if self.store_tma is None:
            object.__setattr__(self, "store_tma", self._store_tma_pays())
        elif self.store_tma and self.scatter:
            raise ValueError("a scattered D is stored from registers, row by row through its index")
        elif self.store_tma and self.fp8_out:
            raise ValueError("an FP8 D is quantized and stored from registers")
        elif self.store_tma and not self.store_tma_possible:
            raise ValueError(
                f"a TMA-stored epilogue needs whole {self.box_cols}-column boxes (tile_n {self.tile_n}, {self.d_type})"
            )
        if self.exit_on_read and not self.store_tma:
            raise ValueError("exit_on_read is about a TMA-stored epilogue's last stores (this one stores from registers)")
        if self.stages == 0:
            object.__setattr__(self, "stages", self._max_stages())
        if not 2 <= self.stages <= MAX_STAGES or self.smem_bytes > self.smem_limit:
            raise ValueError(
                f"{self.stages} stages of a {self.tile_m}x{self.tile_n} tile need "
                f"{self.smem_bytes} B of shared memory (limit {self.smem_limit} B, 2..{MAX_STAGES} stages)"
            )
        if self.mma_lag >= self.stages:
            raise ValueError(f"mma_lag {self.mma_lag} holds every one of {self.stages} stages")
        if not self.name:
            object.__setattr__(self, "name", gemm_kernel_name(self))

    def _validate(self) -> None:
        if self.ctas_per_sm not in (1, 2):
            raise ValueError(f"ctas_per_sm must be 1 or 2, got {self.ctas_per_sm}")
        if self.ctas_per_sm == 2 and self.consumer_warpgroups != 1:
            # Two blocks of 384 threads would leave each thread at most 85 registers.
            raise ValueError("two blocks per SM only with one consumer warpgroup (64-row tiles)")
        if self.ctas_per_sm == 2 and self.tile_n > 192:
            # 128 registers per thread: a 256-wide tile's 128 accumulators do not fit (ptxas refuses).
            raise ValueError("two blocks per SM take tiles of at most 192 columns")
        a, b = self.a_type, self.b_type
        if a not in OPERAND_TYPES or b not in OPERAND_TYPES:
            raise ValueError(f"operand types must be in {sorted(OPERAND_TYPES)}, got {a}, {b}")
        if (a in FP8_TYPES) != (b in FP8_TYPES) or (a not in FP8_TYPES and a != b):
            raise ValueError(f"wgmma cannot mix operand types {a} and {b}")
        if self.d_type not in OUTPUT_TYPES | FP8_TYPES:
            raise ValueError(f"output type must be in {sorted(OUTPUT_TYPES | FP8_TYPES)}, got {self.d_type}")
        if self.scaled:
            if a not in FP8_TYPES:
                raise ValueError("block scales are only supported on FP8 operands")
            if not (self.sa_bk == self.sb_bk and self.sa_bk in (0, 128)) or (self.sa_bk and self.tile_k != 128):
                raise ValueError(
                    "scaled kernels need sa_bk == sb_bk, 128 (blockwise, with tile_k == 128) or 0 "
                    "(the whole of K: per-channel)"
                )
            if self.sa_bm < 1 or self.sb_bn < 1:
                raise ValueError("scale block sizes must be positive")
        if self.tile_m not in (64, 128):
            raise ValueError("tile_m must be 64 or 128 (one consumer warpgroup per 64 rows)")
        if self.tile_n % 8 or not 8 <= self.tile_n <= 256:
            raise ValueError("tile_n must be a multiple of 8 in [8, 256] (a wgmma N)")
        if self.scaled and self.tile_n > 192 and not (self.blockwise and self.tile_n == 2 * MMA_PART_N):
            # Blockwise: two accumulator tiles (256 columns only as two wgmma halves, see
            # mma_parts); per-channel: the scale loads beside a 256-wide accumulator tile spill.
            raise ValueError("scaled kernels: tile_n must be <= 192, or 256 for blockwise scales")
        if self.tile_k <= 0 or self.tile_k % self.atom_k or self.k_atoms not in K_ATOMS:
            raise ValueError(f"tile_k must fill {', '.join(map(str, K_ATOMS))} 128-byte swizzle rows")
        if self.k_atoms > 1 and not self.several_rows_possible:
            raise ValueError(
                "more than one swizzle row of K per stage: no blockwise scales, one CTA per tile, rows not gathered"
            )
        if not 1 <= self.mma_lag <= 2 or (self.mma_lag != 1 and (self.blockwise or self.promotes)):
            raise ValueError("mma_lag must be 1, or 2 in an unscaled main loop that does not promote")
        if self.fast_accum and (self.a_type not in FP8_TYPES or self.blockwise):
            raise ValueError("fast accumulation is for FP8 operands without scales per K block")
        if self.raster < 1:
            raise ValueError("raster must be positive")
        if self.cluster not in (1, 2):
            raise ValueError("cluster must be 1 or 2 (CTA pairs multicast A, or B with multicast_b)")
        if self.multicast_b and (self.cluster != 2 or (self.tile_n // 2) % 8):
            raise ValueError("multicast_b: a CTA pair (cluster 2) whose halves of B are whole 8-row swizzle atoms")
        kinds = [k for k, _ in self.epilogue]
        if kinds != [k for k in EPILOGUE_KINDS if k in kinds]:
            raise ValueError(f"epilogue operands go one per kind, in the order {EPILOGUE_KINDS}")
        for _, t in self.epilogue:
            if t not in OUTPUT_TYPES:
                raise ValueError(f"epilogue operand types must be in {sorted(OUTPUT_TYPES)}, got {t}")
        if self.swiglu:
            if self.accumulate or self.d_type not in SWIGLU_OUTPUT_TYPES:
                raise ValueError(f"a SwiGLU stores (no +=) into {' or '.join(SWIGLU_OUTPUT_TYPES)}")
            if "bias" in kinds:
                raise ValueError("a SwiGLU takes no bias")
            if self.tile_n % 2:
                raise ValueError("a SwiGLU tile holds whole gate/up column pairs: tile_n must be even")
            if self.store_tma:
                raise ValueError("a SwiGLU stores from registers (its output tile is half the tile's width)")
        if self.swiglu_halves:
            if not self.swiglu or self.tile_n % 16 or self.cluster != 1:
                raise ValueError("gate and up halves belong to a SwiGLU: whole 8-row blocks per half, one CTA per tile")
            if self.blockwise and (self.tile_n != 2 * self.sb_bn or self.swiglu_up_rows % self.sb_bn):
                raise ValueError("scaled gate and up halves: each half one B scale block (tile_n = 2 * sb_bn)")
        elif self.swiglu_up_rows:
            raise ValueError("up rows belong to gate and up halves")
        if self.gather_tma and not self.gather:
            raise ValueError("rows by TMA are for a gathered A")
        if self.gather and (self.cluster != 1 or self.per_channel):
            raise ValueError("a gathered A is copied row by row: one CTA per tile (no multicast), no per-channel scales")
        if self.scatter and self.accumulate:
            raise ValueError("a scattered D is stored (=), never added into: rows sharing an index would race")
        if self.fp8_out:
            if self.accumulate or self.scatter:
                raise ValueError("an FP8 D is stored (=) at its own rows: no +=, no scattered rows")
            if self.d_tile_cols % D_SCALE_COLS:
                raise ValueError(
                    f"an FP8 D's tile must cover whole {D_SCALE_COLS}-column scale blocks of D "
                    f"(tile_n {self.tile_n}{' of gate/up pairs' if self.swiglu else ''})"
                )
        elif self.d_scale_pow2:
            raise ValueError("power-of-two scales belong to an FP8 D")
        if self.copy and (not self.fp8_out or self.tile_m != 128):
            raise ValueError("a copy belongs to an FP8 D, in 128-row tiles (one [128, 1] scale block each)")
        if self.copy_pow2 and not self.copy:
            raise ValueError("power-of-two copy scales belong to a copy")
        if self.mma_parts > 1 and self.sb_mode == 2:
            raise ValueError("a 256-column blockwise tile takes one or two B scales per K block")
        if self.n_split not in (1, 2):
            raise ValueError(f"n_split must be 1 or 2, got {self.n_split}")
        if self.n_split == 2 and not (
            self.tile_m == 64 and self.blockwise and self.tile_n == 2 * self.sb_bn == 2 * MMA_PART_N
            and self.ctas_per_sm == 1 and not (self.accumulate or self.swiglu or self.epilogue or self.fp8_out
                                               or self.gather or self.scatter or self.split_k)
        ):
            raise ValueError(
                "columns split between two warpgroups: a 64 x 256 tile of blockwise scales in 128-column "
                "blocks (one B scale block per warpgroup), one block per SM, stored (=) with no fused "
                "epilogue, no SwiGLU, FP8 output, index tensors or split K"
            )

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.a_type]

    @property
    def fp8_out(self) -> bool:
        """D is FP8, quantized in the epilogue with one scale per row and 128 columns."""
        return self.d_type in FP8_TYPES

    @property
    def d_tile_cols(self) -> int:
        """Columns of D a tile writes: its width, or half of it for a SwiGLU."""
        return self.tile_n // 2 if self.swiglu else self.tile_n

    @property
    def mma_parts(self) -> int:
        """wgmma batches per K block and consumer warpgroup: a warpgroup of 256 blockwise
        columns runs its K block in two 128-column halves, each into one half-width K-block
        accumulator promoted before the next (two full-width accumulator tiles would not fit
        the registers); else 1."""
        return self.wg_cols // MMA_PART_N if self.blockwise and self.wg_cols > 192 else 1

    @property
    def wg_cols(self) -> int:
        """Columns of the tile one consumer warpgroup computes (see ``n_split``)."""
        return self.tile_n // self.n_split

    @property
    def consumer_warpgroups(self) -> int:
        return self.tile_m // 64 * self.n_split

    @property
    def threads(self) -> int:
        """Consumer warpgroups plus one producer warpgroup."""
        return 128 * (self.consumer_warpgroups + 1)

    @property
    def reallocates_registers(self) -> bool:
        """With three warpgroups the register file is the limit: move registers from the
        producer to the consumers (setmaxnreg). With two, every thread already has 255."""
        return self.consumer_warpgroups == 2

    @property
    def per_channel(self) -> bool:
        """One scale per row of A and per column of B over the whole of K."""
        return self.scaled and self.sa_bk == 0

    @property
    def smem_scales(self) -> bool:
        """The producer stages each stage's scales in shared memory for the consumers."""
        return self.blockwise and not self.consumer_scales

    @property
    def memory_bound(self) -> bool:
        """Tiles of 64 rows and at most 32 columns: bound by reading A (the LoRA shrink's)."""
        return self.tile_m == 64 and self.tile_n <= 32

    def split_possible(self, store_tma: bool | None = None) -> bool:
        """Split K is implemented for these (see ``split_k``); `store_tma` stands for the
        configuration's own. Not with a staged 16-bit `+=`, which loads a tile's old D when
        the tile starts, in every block that shares it."""
        store_tma = self.store_tma if store_tma is None else store_tma
        # Blockwise scales staged by the producer follow the run's K blocks; the consumers'
        # own scale loads start at K block 0. A CTA pair splits its unit's tiles alike.
        main_loop = not self.scaled or (self.blockwise and self.consumer_scales is not True)
        return (main_loop and (self.cluster == 1 or not self.memory_bound) and not self._adds_staged(store_tma)
                and not self.gather and not self.scatter and not self.fp8_out and not self.copy)

    def split_by_default(self) -> bool:
        """Split K as the emitter's default takes it: memory-bound tiles with their epilogue
        from registers, wider ones with their own (the leaves must also share one K)."""
        return self.split_possible(store_tma=False if self.memory_bound else None)

    @property
    def split_bytes(self) -> int:
        """Shared memory of the block's split plan and run (split K)."""
        return SPLIT_WORK_BYTES if self.split_k else 0

    @property
    def split_max_blocks(self) -> int:
        """The most blocks that take part in split K (see SPLIT_MAX_SMS)."""
        return min(SPLIT_MAX_SMS * self.ctas_per_sm, INLINE_MAX_BLOCKS)

    @property
    def split_sums_bytes(self) -> int:
        """The partial sums of a split-K kernel: two tile-sized f32 slots per block (for
        wider tiles: one per split tile, fewer than two per block)."""
        return self.split_max_blocks * 2 * self.tile_m * self.tile_n * 4 if self.split_k else 0

    @property
    def split_counters(self) -> int:
        """The arrival counters of a split-K kernel: one int32 per consumer warpgroup and
        block (memory-bound tiles, two per SM) or split tile (fewer than two per block),
        zero before the first launch; the last arrival sets each back to zero."""
        return 2 * self.split_max_blocks * self.consumer_warpgroups if self.split_k else 0

    def products_possible(self) -> bool:
        """The producer can stage SA x SB products (see ``staged_products``)."""
        return (self.smem_scales and self.sb_mode != 2 and self.mma_parts == 1 and not self.gather
                and self.n_split == 1)

    def early_scales_by_default(self) -> bool:
        """Staged scales read before the K block's wgmma issue: where B's scales change
        per column (see ``scales_before_issue``)."""
        return self.smem_scales and self.sb_mode == 2

    @property
    def promotes(self) -> bool:
        """FP8 products without scales per K block still go into f32 every 128 of K (each
        K block's wgmma into a fresh accumulator, added into the result), as DeepSeek-V3's
        recipe does and torch's FP8 GEMMs do by default; not with ``fast_accum``."""
        return self.a_type in FP8_TYPES and not self.blockwise and not self.fast_accum

    @property
    def blockwise(self) -> bool:
        """Scales per 128-wide K block: the main loop promotes after every K block."""
        return self.scaled and not self.per_channel

    @property
    def sb_mode(self) -> int:
        """B scales per tile and K block: 0 when every column of a tile lies in one B scale
        block (one scale), 1 when a tile straddles at most one block boundary (two scales;
        tile_n - sb_bn <= gcd(tile_n, sb_bn) guarantees it for tiles at multiples of tile_n),
        2 otherwise (one scale per column). Unscaled and per-channel kernels: 0."""
        if not self.blockwise or self.sb_bn % self.tile_n == 0:
            return 0
        if self.sb_bn % 8 == 0 and self.tile_n <= self.sb_bn + math.gcd(self.tile_n, self.sb_bn):
            return 1
        return 2

    @property
    def sb_splits(self) -> tuple[int, ...]:
        """In mode 1, the possible counts of 8-column groups of a consumer warpgroup's
        columns before their block boundary (the kernel compiles one main loop per count;
        with split columns each warpgroup's lie in one block: the one count is all of them)."""
        if self.sb_mode != 1:
            return ()
        g = math.gcd(self.wg_cols, self.sb_bn)
        return tuple(sorted({min((self.sb_bn - r) // 8, self.wg_cols // 8) for r in range(0, self.sb_bn, g)}))

    @property
    def box_cols(self) -> int:
        """Columns of D in one 128-byte swizzle row: the width of a staged epilogue box."""
        return SWIZZLE_BYTES // ELEMENT_BYTES[self.d_type]

    @property
    def late_d_maps(self) -> bool:
        """With whole-buffer maps: the consumers write the block's D maps at their start, each
        thread in its own 128-byte slot of the epilogue's staging, rather than the table's
        build in the ring's first stage before the GEMM starts (and the ring's mbarriers are
        initialised during the table's build). For a 16- or 32-bit D stored by TMA (no
        SwiGLU, FP8 output or staged `+=`), no tile split, and a staging of at least 128
        bytes per consumer thread (a warpgroup's columns at least 256 bytes wide)."""
        return bool(
            self.whole_maps and self.store_tma and not self.split_k and not self.staged_add and not self.swiglu
            and not self.fp8_out and self.tile_n // self.n_split * ELEMENT_BYTES[self.d_type] >= 256
        )

    @property
    def store_tma_possible(self) -> bool:
        return self.tile_n % self.box_cols == 0

    @property
    def staged_add(self) -> bool:
        """A 16-bit D += through the staging: the old tile loaded by TMA, added to in f32 and
        stored back (an f32 D += reduce-adds in the store instead)."""
        return self._adds_staged(self.store_tma)

    def _adds_staged(self, store_tma: bool | None) -> bool:
        return bool(store_tma) and self.accumulate and ELEMENT_BYTES[self.d_type] == 2

    @property
    def staging_bytes(self) -> int:
        """Shared memory of the staged epilogue: the whole tile of D."""
        return self._tile_d_bytes if self.store_tma else 0

    @property
    def _tile_d_bytes(self) -> int:
        return self.tile_m * self.tile_n * ELEMENT_BYTES[self.d_type]

    def _stages_beside(self, staging: int) -> int:
        """Ring stages (operands, scales, an mbarrier pair) that fit beside `staging` bytes
        (and a gathered tile's row numbers)."""
        per_stage = self.stage_bytes + self.scale_bytes + 16
        inline = self.inline_bytes + INLINE_ROUNDING + self.inline_static if self.inline_table else 0
        fixed = SMEM_ALIGN + staging + self.rows_bytes + self.copy_bytes + self.split_bytes + inline
        return (self.smem_limit - fixed) // per_stage

    @property
    def inline_bytes(self) -> int:
        """Shared memory of a table built in the kernel, after everything else (128-byte
        aligned): the emitter's records and checked offsets."""
        return _ceil_div(self.inline_table, 16) * 16

    @property
    def copy_bytes(self) -> int:
        """Shared memory of a copy's epilogue, beside the ring: the tile's quantized bytes
        staged transposed (a COPY_COL_PITCH-byte row per column of D), each consumer warp's
        column amaxes, and the columns' scales."""
        if not self.copy:
            return 0
        cols = self.d_tile_cols
        return cols * COPY_COL_PITCH + 4 * cols * (4 * self.consumer_warpgroups) + 4 * cols

    @property
    def rows_bytes(self) -> int:
        """Shared memory of a gathered tile's row numbers: an int per tile row (the producer
        reads them once per tile, then copies rows and scales from them)."""
        return 4 * self.tile_m if self.gather else 0

    @property
    def smem_limit(self) -> int:
        """Shared memory one block may use with `ctas_per_sm` blocks resident per SM."""
        return min(SMEM_LIMIT, SM_SMEM // self.ctas_per_sm - SMEM_RESERVED_PER_CTA)

    def rounds_by_default(self) -> bool:
        """The scaled loop runs in rounds unless the consumers load the scales (ptxas then
        schedules them late) or fused epilogue operands leave no registers for the unrolled
        round (ptxas spills)."""
        return self.blockwise and not self.consumer_scales and not self.epilogue

    def bias_crowds_registers(self) -> bool:
        """A promoting tile wider than 128 columns with a fused bias: its consumers hold two
        accumulator tiles and the bias, with no registers left for staging addresses,
        scales loaded ahead or wgmma descriptors kept across the tile."""
        return (self.blockwise or self.promotes) and self.tile_n > 128 and any(k == "bias" for k, _ in self.epilogue)

    def lean_by_default(self) -> bool:
        """Descriptors rebuilt per instruction (``lean_registers``) where the registers are
        short: a fused bias beside two accumulator tiles, or a per-channel tile wider than
        128 columns that promotes and reduce-adds into an f32 D (its second accumulator
        tile, the channel scales and the staging addresses spilled 8 bytes otherwise)."""
        crowded = self.promotes and self.per_channel and self.tile_n > 128 and self.accumulate
        return self.bias_crowds_registers() or crowded

    def _store_tma_pays(self) -> bool:
        if not self.store_tma_possible or self.swiglu or self.scatter or self.fp8_out:
            # A SwiGLU's output tile is TILE_N / 2 columns wide, which the staging boxes (and
            # the D map's box width) do not describe; from registers it needs no shared memory,
            # so the ring keeps those stages.
            return False
        if self.bias_crowds_registers():
            # Two accumulator tiles, the bias loads and the staging addresses do not fit
            # the registers together (ptxas spills); these store from registers.
            return False
        return self._stages_beside(self._tile_d_bytes) >= MIN_STAGES_WITH_STAGING

    @property
    def atom_k(self) -> int:
        """K elements of one 128-byte swizzle row (a TMA box's contiguous extent)."""
        return SWIZZLE_BYTES // ELEMENT_BYTES[self.a_type]

    @property
    def k_atoms(self) -> int:
        """128-byte swizzle rows of K per ring stage (one TMA box per operand each)."""
        return self.tile_k // self.atom_k

    @property
    def several_rows_possible(self) -> bool:
        """A ring stage may hold more than one swizzle row of K: no blockwise promotion
        (its K block is one row), one CTA per tile, rows not gathered (one-row boxes)."""
        return not self.blockwise and self.cluster == 1 and not self.gather

    @property
    def stage_bytes(self) -> int:
        return (self.tile_m + self.tile_n) * SWIZZLE_BYTES * self.k_atoms

    @property
    def scale_bytes(self) -> int:
        """Scales of one stage: a float per tile row, then the B scales (sb_mode)."""
        if not self.blockwise or self.consumer_scales:
            return 0
        if self.staged_products:  # a product per row and B scale
            return 4 * self.tile_m * (1, 2)[self.sb_mode]
        floats = self.tile_m + (1, 2, self.tile_n)[self.sb_mode]
        return 16 * _ceil_div(floats, 4)  # padded to 16 bytes

    def _max_stages(self) -> int:
        return min(MAX_STAGES, self._stages_beside(self.staging_bytes))

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per block; the template static_asserts the same sum:
        alignment slack, the ring's operands, the epilogue staging, the ring's scales, a
        full/empty mbarrier pair per stage, an mbarrier per consumer warpgroup for a staged
        add and, when A is gathered, the tile's row numbers."""
        total = (
            SMEM_ALIGN + self.stages * (self.stage_bytes + self.scale_bytes) + self.staging_bytes + 16 * self.stages
            + 8 * self.consumer_warpgroups * self.staged_add + self.rows_bytes + self.copy_bytes + self.split_bytes
        )
        if self.inline_table:  # the table's region starts at the next 128-byte boundary
            total = SMEM_ALIGN + _ceil_div(total - SMEM_ALIGN, 128) * 128 + self.inline_bytes
        return total

    def tiles(self, m: int, n: int) -> int:
        """Output tiles of one leaf; the leaf table's tile_begin sums these."""
        return _ceil_div(m, self.tile_m) * _ceil_div(n, self.tile_n) if m > 0 and n > 0 else 0


@dataclass(frozen=True)
class MapSpec:
    """One per-leaf TMA tensor map of a grouped GEMM launch, as its host-encoded template
    fixes it: element type and box (``box_inner`` contiguous elements, one 128-byte
    swizzle row, by ``box_rows`` rows), 128-byte swizzle, 256-byte L2 promotion, zero
    fill. The leaf-table builder patches each leaf's base address, extents and row stride
    into a copy. ``operand`` is "a" or "b" (loads) or "d" (the output, stored by TMA)."""

    operand: str
    dtype: str
    box_inner: int
    box_rows: int


def map_specs(cfg: GemmKernelConfig) -> tuple[MapSpec, ...]:
    """The tensor maps each leaf of a launch owns, in their order in the maps buffer
    (leaf i's maps start at i * len(map_specs(cfg))). In a cluster each CTA loads (and
    multicasts) its share of A's rows."""
    # A gathered by TMA: a box of one row, one load per tile row.
    maps = (
        MapSpec("a", cfg.a_type, cfg.atom_k,
                1 if cfg.gather_tma else cfg.tile_m // (1 if cfg.multicast_b else cfg.cluster)),
        MapSpec("b", cfg.b_type, cfg.atom_k,
                cfg.tile_n // 2 if cfg.swiglu_halves else cfg.tile_n // (cfg.cluster if cfg.multicast_b else 1)),
    )
    if cfg.swiglu_halves:  # the gate rows from B's map, the up rows from this one
        return maps + (MapSpec("u", cfg.b_type, cfg.atom_k, cfg.tile_n // 2),)
    # The staged epilogue stores each consumer warpgroup's 64 rows one box at a time.
    return maps + (MapSpec("d", cfg.d_type, cfg.box_cols, 64),) if cfg.store_tma else maps


def gemm_kernel_name(cfg: GemmKernelConfig) -> str:
    """Deterministic C identifier, e.g. gs_sm90a_e4m3e4m3_bf16_sa1x128_sb128x128_t128x128x128_w384s6_store."""
    scales = f"sa{cfg.sa_bm}x{cfg.sa_bk or 'K'}_sb{cfg.sb_bn}x{cfg.sb_bk or 'K'}" if cfg.scaled else "noscale"
    mode = "acc" if cfg.accumulate else "store"
    raster = f"r{cfg.raster}" if cfg.raster != 8 else ""
    raster += f"o{cfg.ctas_per_sm}" if cfg.ctas_per_sm != 1 else ""
    cluster = cluster_suffix(cfg.cluster, cfg.multicast_b)
    staged = "_tma" if cfg.store_tma else ""
    if cfg.consumer_scales:  # not the default
        staged += "_consumerscales"
    if cfg.consumer_scales and not cfg.prefetch_scales:
        staged += "_inplacescales"
    if cfg.lean_registers != cfg.lean_by_default():  # not the default: named apart
        staged += "_lean" if cfg.lean_registers else "_roomy"
    if cfg.epilogue:
        staged += "_e" + "".join(f"{k[0]}{t}" for k, t in cfg.epilogue)
    if cfg.swiglu:
        staged += "_swiglu"
    if cfg.swiglu_halves:
        staged += "_halves" + (str(cfg.swiglu_up_rows) if cfg.swiglu_up_rows else "")
    if cfg.gather:
        staged += "_gather" if cfg.gather_tma else "_gathercopy"  # by TMA: the default
    if cfg.blockwise and cfg.ring_rounds != cfg.rounds_by_default():  # not the default
        staged += "_rounds" if cfg.ring_rounds else "_norounds"
    if cfg.scales_before_issue != cfg.early_scales_by_default():  # not the default
        staged += "_earlyscales" if cfg.scales_before_issue else "_latescales"
    if cfg.staged_products != cfg.products_possible():  # not the default
        staged += "_rawscales"
    if cfg.scatter:
        staged += "_scatter"
    if cfg.cache_hints != (cfg.memory_bound and cfg.cluster == 1):  # not the default
        staged += "_hints" if cfg.cache_hints else "_nohints"
    if cfg.b_evict_first:
        staged += "_bfirst"
    if cfg.split_k:
        staged += "_splitk"
    if cfg.mma_lag != 1:
        staged += f"_lag{cfg.mma_lag}"
    if cfg.fast_accum:
        staged += "_fastacc"
    if cfg.inline_table:
        staged += "_inl" + ("_whole" if cfg.whole_maps else "")
    elif not cfg.programmatic:
        staged += "_nopdl"
    if cfg.prefetch_k_blocks:
        staged += f"_pf{cfg.prefetch_k_blocks}"
    if cfg.exit_on_read:
        staged += "_xr"
    if cfg.d_scale_pow2:
        staged += "_pow2"
    if cfg.copy:
        staged += "_copy128x1" + ("pow2" if cfg.copy_pow2 else "")
    return (
        f"gs_sm90a_{cfg.a_type}{cfg.b_type}_{cfg.d_type}_{scales}"
        f"_t{cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k}_w{cfg.threads}s{cfg.stages}{raster}{cluster}_{mode}{staged}"
    )


@dataclass(frozen=True)
class RequantKernelConfig:
    """Requantize row-major 1xSX_BK-scaled FP8 to per-segment transposed BLOCK_Tx1 FP8."""

    in_type: str = "e4m3"
    out_type: str = "e4m3"
    block_t: int = 128  # tokens per output scale block (anchored at each segment start)
    tile_c: int = 128  # channels per CTA; equals sx_bk so one input scale per token row
    sx_bk: int = 128
    threads: int = 256
    name: str = ""
    # Segments written in padded lengths (segment_major(G) pad P): segment g starts at the
    # sum of round_up(len, pad) over the segments before it, its rows round_up(len, pad) apart.
    pad: int = 1
    # requantize(X, rows = idx): token t reads row idx[t] of X (a zero row outside X).
    gather_rows: bool = False
    # requantize(X, weight = W): token t's row is multiplied by W[t] before quantizing.
    row_weight: bool = False
    # swiglu_grad(X, DH) into 128x1 blocks: X (in_type, 16-bit or f32) the gate/up columns,
    # DH (dh_type) the gradient of the SwiGLU's output; the gradients are what is quantized.
    swiglu: bool = False
    dh_type: str = "bf16"

    def __post_init__(self) -> None:
        if self.swiglu:
            if self.in_type not in QUANTIZE_IN_TYPES or self.dh_type not in QUANTIZE_IN_TYPES or self.out_type not in FP8_TYPES:
                raise ValueError("swiglu_grad reads bf16, f16 or f32 and writes FP8")
            if self.gather_rows or self.row_weight:
                raise ValueError("swiglu_grad reads its rows as they are")
        elif self.in_type not in FP8_TYPES or self.out_type not in FP8_TYPES:
            raise ValueError("requant reads and writes FP8")
        if self.pad <= 0 or self.pad & (self.pad - 1):
            raise ValueError("pad must be a power of two")
        if self.tile_c != self.sx_bk or self.tile_c % 4 or self.threads % self.tile_c:
            raise ValueError("tile_c must equal sx_bk, be a multiple of 4 and divide threads")
        if self.threads % 32 or self.block_t <= 0:
            raise ValueError("threads must be whole warps, block_t positive")
        if not self.name:
            object.__setattr__(
                self,
                "name",
                (f"gs_sm90a_swiglu_grad_{self.in_type}_{self.dh_type}_{self.out_type}" if self.swiglu else
                 f"gs_sm90a_requant_{self.in_type}_{self.out_type}_sx1x{self.sx_bk}")
                + f"_sy{self.block_t}x1_c{self.tile_c}_w{self.threads}"
                f"{f'_p{self.pad}' if self.pad > 1 else ''}"
                f"{'_rows' if self.gather_rows else ''}{'_rw' if self.row_weight else ''}",
            )


@dataclass(frozen=True)
class QuantizeKernelConfig:
    """Quantize bf16/f16/f32 [B, R, C] (C contiguous) to dense row-major FP8 with
    block_r x block_c scales: one warp per [1, 128] block, one CTA per [128, 128].
    ``pow2``: each scale is the least power of two 2^e (e >= -127) with
    amax <= FP8 max * 2^e, found exactly from the bits of amax."""

    in_type: str = "bf16"
    out_type: str = "e4m3"
    block_r: int = 1  # rows per scale block: 1 or block_c
    block_c: int = 128  # columns per scale block: 32 lanes of 4
    threads: int = 256
    name: str = ""
    pow2: bool = False
    # swiglu_grad: X holds a SwiGLU's gate/up columns (2j, 2j + 1) and DH (of `dh_type`)
    # the gradient of its output column j; the quantized values are their gradients.
    swiglu_grad: bool = False
    dh_type: str = "bf16"

    def __post_init__(self) -> None:
        if self.in_type not in QUANTIZE_IN_TYPES or self.out_type not in FP8_TYPES:
            raise ValueError("quantize reads bf16, f16 or f32 and writes FP8")
        if self.swiglu_grad and (self.block_r != 1 or self.pow2 or self.dh_type not in QUANTIZE_IN_TYPES):
            raise ValueError("swiglu_grad quantizes into [1, 128] blocks with scales amax / FP8 max")
        if self.block_c != 32 * QUANTIZE_PER_LANE or self.block_r not in (1, self.block_c):
            raise ValueError(f"quantize blocks are 1x{32 * QUANTIZE_PER_LANE} or square")
        if self.threads % 32 or (self.block_r > 1 and self.block_r % (self.threads // 32)):
            raise ValueError("threads must be whole warps that split a block's rows evenly")
        if not self.name:
            object.__setattr__(
                self,
                "name",
                f"gs_sm90a_{'swiglu_grad' if self.swiglu_grad else 'quantize'}_{self.in_type}"
                f"{f'_{self.dh_type}' if self.swiglu_grad else ''}_{self.out_type}_b{self.block_r}x{self.block_c}"
                f"_w{self.threads}{'_pow2' if self.pow2 else ''}",
            )

    @property
    def rows_per_cta(self) -> int:
        """A CTA covers one block of rows, or one row per warp for [1, C] blocks."""
        return self.block_r if self.block_r > 1 else self.threads // 32


@dataclass(frozen=True)
class GatherRowsKernelConfig:
    """Copy rows of X named by an int32 index into a dense Y (the gather pre-pass), with
    their [1, 128] scales when `scaled`: one warp per row, 16-byte copies."""

    elem_bytes: int = 1
    scaled: bool = True
    threads: int = 256
    rows_per_cta: int = 32  # lane l of a warp copies the scales of the CTA's row l
    unroll: int = 4  # 16-byte loads in flight per lane
    name: str = ""

    def __post_init__(self) -> None:
        if self.elem_bytes not in (1, 2) or self.threads % 32 or self.rows_per_cta != 32:
            raise ValueError("gather rows copies 1- or 2-byte elements, 32 rows per CTA of whole warps")
        if self.rows_per_cta % (self.threads // 32):
            raise ValueError("the warps split a CTA's rows evenly")
        if not self.name:
            object.__setattr__(
                self, "name",
                f"gs_sm90a_gather_rows_e{self.elem_bytes}{'_scaled' if self.scaled else ''}_w{self.threads}",
            )


# scatter_add's index kernels (zero, count, place: one thread per entry) and its scan (one
# block of 32 warps, whose totals one warp scans).
SCATTER_AUX_THREADS = 256
SCATTER_SCAN_THREADS = 1024
# Its steps in launch order: (manifest role, kernel symbol suffix); the last one sums.
SCATTER_STEPS = (
    ("scatter_zero", "_zero"),
    ("scatter_count", "_count"),
    ("scatter_scan", "_scan"),
    ("scatter_place", "_place"),
    ("scatter_add", ""),
)


@dataclass(frozen=True)
class RowPassKernelConfig:
    """A row pass after the launches (`rowdot`, `rowscale`, `scatter_add`): one warp per
    row of an [R, C] tensor with contiguous rows. rowdot reads `other_type` beside
    `in_type` (FP8 with [1, 128] scales when `scaled`) and writes one f32 per row;
    rowscale writes `out_type`; scatter_add writes `out_type`, one warp per target row,
    after the four kernels that build its inverse index (SCATTER_STEPS)."""

    kind: str = "rowdot"
    in_type: str = "bf16"
    other_type: str = "e4m3"
    scaled: bool = True
    out_type: str = "f32"
    threads: int = 256
    name: str = ""

    @property
    def rows_per_cta(self) -> int:
        return self.threads // 32

    def __post_init__(self) -> None:
        if self.kind not in ("rowdot", "rowscale", "scatter_add") or self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError("a row pass is rowdot, rowscale or scatter_add, in whole warps")
        if not self.name:
            tail = (
                f"{self.in_type}_{self.other_type}{'_scaled' if self.scaled else ''}"
                if self.kind == "rowdot" else f"{self.in_type}_{self.out_type}"
            )
            object.__setattr__(self, "name", f"gs_sm90a_{self.kind}_{tail}_w{self.threads}")


@dataclass(frozen=True)
class TransposeKernelConfig:
    """Batched byte transpose [Bt, K, N] -> [Bt, N, K] for FP8 operands."""

    tile: int = 64
    threads: int = 256
    name: str = ""

    def __post_init__(self) -> None:
        if self.tile % 4 or self.tile <= 0 or self.threads % 32:
            raise ValueError("tile must be a positive multiple of 4, threads whole warps")
        if not self.name:
            object.__setattr__(self, "name", f"gs_sm90a_transpose_b8_t{self.tile}_w{self.threads}")


def render_gemm(cfg: GemmKernelConfig) -> str:
    return ENV.get_template("grouped_gemm.cu.jinja").render(
        name=cfg.name,
        a_type=cfg.a_type,
        b_type=cfg.b_type,
        d_type=cfg.d_type,
        accumulate=cfg.accumulate,
        # SCALED in the template is the per-K-block promotion; per-channel kernels run the
        # unscaled main loop and scale in the epilogue instead.
        scaled=cfg.blockwise,
        per_channel=cfg.per_channel,
        sa_bm=cfg.sa_bm,
        sa_bk=cfg.sa_bk,
        sb_bn=cfg.sb_bn,
        sb_bk=cfg.sb_bk,
        sb_mode=cfg.sb_mode,
        sb_splits=cfg.sb_splits,
        store_tma=cfg.store_tma,
        consumer_scales=cfg.consumer_scales,
        prefetch_scales=cfg.prefetch_scales,
        lean_registers=cfg.lean_registers,
        ctas_per_sm=cfg.ctas_per_sm,
        maps_per_leaf=len(map_specs(cfg)),
        tile_m=cfg.tile_m,
        tile_n=cfg.tile_n,
        tile_k=cfg.tile_k,
        k_atoms=cfg.k_atoms,
        mma_lag=cfg.mma_lag,
        promote=cfg.promotes,
        stages=cfg.stages,
        raster=cfg.raster,
        cluster=cfg.cluster,
        multicast_b=cfg.multicast_b,
        consumer_wgs=cfg.consumer_warpgroups,
        threads=cfg.threads,
        realloc=cfg.reallocates_registers,
        producer_regs=PRODUCER_REGS,
        consumer_regs=CONSUMER_REGS,
        smem_bytes=cfg.smem_bytes,
        mma=wgmma_struct(cfg.wg_cols // cfg.mma_parts, cfg.a_type, cfg.b_type),
        n_split=cfg.n_split,
        mma_parts=cfg.mma_parts,
        epilogue=dict(cfg.epilogue),
        swiglu=cfg.swiglu,
        swiglu_halves=cfg.swiglu_halves,
        swiglu_up_rows=cfg.swiglu_up_rows,
        # B's scales as the kernel's parts take them: a scaled SwiGLU over gate and up
        # halves passes the gate's and the up weight's together.
        sb_decl="GsHalfScales SB" if cfg.swiglu_halves and cfg.blockwise else "const float* __restrict__ SB",
        sb_arg="GsHalfScales{SB, SU}" if cfg.swiglu_halves and cfg.blockwise else "SB",
        gather=cfg.gather,
        gather_tma=cfg.gather_tma,
        scatter=cfg.scatter,
        programmatic=cfg.programmatic,
        ring_rounds=cfg.ring_rounds,
        scales_before_issue=cfg.scales_before_issue,
        smem_scales=cfg.smem_scales,
        staged_products=cfg.staged_products,
        staged_add=cfg.staged_add,
        fp8_out=cfg.fp8_out,
        out_max=repr(FP8_MAX[cfg.d_type]) if cfg.fp8_out else "",
        out_interp=FP8_INTERP[cfg.d_type] if cfg.fp8_out else "",
        d_scale_cols=D_SCALE_COLS,
        pow2=cfg.d_scale_pow2,
        out_max_exp=fp8_max_exponent(cfg.d_type) if cfg.fp8_out else 0,
        copy=cfg.copy,
        copy_pow2=cfg.copy_pow2,
        copy_col_pitch=COPY_COL_PITCH,
        split_k=cfg.split_k,
        split_max_blocks=cfg.split_max_blocks,
        split_bytes=cfg.split_bytes,
        memory_bound=cfg.memory_bound,
        cache_hints=cfg.cache_hints,
        b_evict_first=cfg.b_evict_first,
        exit_on_read=cfg.exit_on_read,
        inline_table=bool(cfg.inline_table),
        whole_maps=cfg.whole_maps,
        late_d_maps=cfg.late_d_maps,
        inline_table_bytes=cfg.inline_table,
        inline_bytes=cfg.inline_bytes,
        inline_max_blocks=INLINE_MAX_BLOCKS,
    )


def render_requant(cfg: RequantKernelConfig | None = None) -> str:
    cfg = cfg or RequantKernelConfig()
    return ENV.get_template("requant.cu.jinja").render(
        pass_kind="requant",
        name=cfg.name,
        in_type=cfg.in_type,
        out_type=cfg.out_type,
        out_max=repr(FP8_MAX[cfg.out_type]),
        out_interp=FP8_INTERP[cfg.out_type],
        block_t=cfg.block_t,
        tile_c=cfg.tile_c,
        sx_bk=cfg.sx_bk,
        threads=cfg.threads,
        pad=cfg.pad,
        gather_rows=cfg.gather_rows,
        row_weight=cfg.row_weight,
        swiglu=cfg.swiglu,
        dh_type=cfg.dh_type,
    )


def render_quantize(cfg: QuantizeKernelConfig | None = None) -> str:
    cfg = cfg or QuantizeKernelConfig()
    return ENV.get_template("quantize.cu.jinja").render(
        name=cfg.name,
        in_type=cfg.in_type,
        out_type=cfg.out_type,
        out_max=repr(FP8_MAX[cfg.out_type]),
        out_interp=FP8_INTERP[cfg.out_type],
        vec_ctype=QUANTIZE_VECTOR[ELEMENT_BYTES[cfg.in_type]],
        block_r=cfg.block_r,
        block_c=cfg.block_c,
        per_lane=QUANTIZE_PER_LANE,
        rows_per_cta=cfg.rows_per_cta,
        row_passes=cfg.block_r // (cfg.threads // 32) if cfg.block_r > 1 else 1,
        threads=cfg.threads,
        pow2=cfg.pow2,
        out_max_exp=fp8_max_exponent(cfg.out_type),
        swiglu_grad=cfg.swiglu_grad,
        dh_type=cfg.dh_type,
    )


def render_gather_rows(cfg: GatherRowsKernelConfig | None = None) -> str:
    cfg = cfg or GatherRowsKernelConfig()
    return ENV.get_template("gather_rows.cu.jinja").render(
        name=cfg.name, eb=cfg.elem_bytes, scaled=cfg.scaled, threads=cfg.threads,
        rows_per_cta=cfg.rows_per_cta, unroll=cfg.unroll, block_c=128,
    )


def render_row_pass(cfg: RowPassKernelConfig | None = None) -> str:
    cfg = cfg or RowPassKernelConfig()
    return ENV.get_template("rows.cu.jinja").render(
        pass_kind=cfg.kind, name=cfg.name, in_type=cfg.in_type, other_type=cfg.other_type,
        scaled=cfg.scaled, out_type=cfg.out_type, threads=cfg.threads,
        rows_per_cta=cfg.rows_per_cta, block_c=128, aux_threads=SCATTER_AUX_THREADS,
        scan_threads=SCATTER_SCAN_THREADS, vec=16 // ELEMENT_BYTES[cfg.in_type],
        out_words=16 // ELEMENT_BYTES[cfg.in_type] * ELEMENT_BYTES[cfg.out_type] // 4,
    )


def render_transpose(cfg: TransposeKernelConfig | None = None) -> str:
    cfg = cfg or TransposeKernelConfig()
    # The transpose lives beside the requant kernel: both are FP8 pre-passes.
    return ENV.get_template("requant.cu.jinja").render(
        pass_kind="transpose", name=cfg.name, tile=cfg.tile, threads=cfg.threads
    )
