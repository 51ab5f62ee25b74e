"""The wgmma instruction of one kernel, spelled out as a small C++ struct.

`wgmma.mma_async` names every accumulator register in its operand list, so the
inline assembly depends on the tile width N (N / 2 floats per thread). Rather than
a header holding every width, each kernel gets exactly the one it issues.
"""

from __future__ import annotations

# PTX type names and the K of one instruction per operand type.
_PTX_TYPE = {"e4m3": "e4m3", "e5m2": "e5m2", "bf16": "bf16", "f16": "f16"}
_INSTR_K = {"e4m3": 32, "e5m2": 32, "bf16": 16, "f16": 16}


def wgmma_k(a_type: str) -> int:
    """K extent of one wgmma instruction for this operand type (always 32 bytes)."""
    return _INSTR_K[a_type]


def wgmma_struct(n: int, a_type: str, b_type: str) -> str:
    """C++ `struct Mma` with `mma(d, desc_a, desc_b, scale_d)` issuing m64nNkK, both operands
    read from shared memory through descriptors, f32 accumulators.

    scale_d == 0 makes D = A*B (a fresh accumulator), otherwise D += A*B. FP8 has no
    transpose flags (both operands K-major); 16-bit types pass 0, 0 (K-major) too.
    Thread t of the warpgroup holds rows 16*(t/32) + (t%32)/4 (+8) and columns
    8j + 2*(t%4) (+1): d[4j] = (r, c), d[4j+1] = (r, c+1), d[4j+2] = (r+8, c),
    d[4j+3] = (r+8, c+1).
    """
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma N must be a multiple of 8 in [8, 256], got {n}")
    if a_type not in _PTX_TYPE or b_type not in _PTX_TYPE:
        raise ValueError(f"no wgmma for operand types {a_type}, {b_type}")
    k = _INSTR_K[a_type]
    regs = n // 2
    fp8 = k == 32
    imm = ", 1, 1" if fp8 else ", 1, 1, 0, 0"
    dlist = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    types = f"{_PTX_TYPE[a_type]}.{_PTX_TYPE[b_type]}"
    instr = f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{types}"
    return "\n".join(
        [
            "struct Mma {",
            f"  static constexpr int kN = {n};",
            f"  static constexpr int kK = {k};",
            f"  static constexpr int kRegs = {regs};",
            f"  static __device__ __forceinline__ void mma(float (&d)[{regs}], unsigned long long da,",
            "                                             unsigned long long db, int scale_d) {",
            "    asm volatile(",
            f'        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"',
            f'        "{instr} "',
            f'        "{{{dlist}}}, "',
            f'        "%{regs}, %{regs + 1}, p{imm};\\n}}\\n"',
            f"        : {outs}",
            '        : "l"(da), "l"(db), "r"(scale_d)',
            '        : "memory");',
            "  }",
            "};",
        ]
    )
