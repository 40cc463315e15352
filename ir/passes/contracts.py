"""plan_contracts: what the kernel expects of each operand, and who quantizes it.

For every forward operand: payload dtype, block size, scale dtype and layout, the
major-ness the consuming MMA needs, where the MMA reads it, and who produces the
low-precision payload (the host/offline quantizer, the producer warp, the
softmax warps, or the epilogue).
"""
from __future__ import annotations

from dataclasses import replace

from ..plan import KernelPlan, OperandContract
from ..spec import KernelSpec, OperandFormat, PKind, ScaleGranularity, Target

# tcgen05 block-scaled MMAs read scale factors in the "32x4x4" atom: 128 rows (32 lanes x
# 4 warps' quadrants) x 4 consecutive scale factors along K; one atom covers K = 4 * block
# (K64 for 1x16 blocks, K128 for 1x32 blocks) and takes 4 TMEM columns once copied.
SF_ATOM_ROWS = 128
SF_ATOM_BLOCKS = 4
SF_ATOM_COLS = 4


def sf_atoms(rows: int, k: int, block: int) -> int:
    """Scale-factor atoms for an operand of ``rows`` x ``k`` (k = reduction length)."""
    per_k = SF_ATOM_BLOCKS * block
    return -(-rows // SF_ATOM_ROWS) * -(-k // per_k)


def _granularity(f: OperandFormat) -> str:
    return f.granularity.value


def _sm100(spec: KernelSpec, plan: KernelPlan) -> tuple[OperandContract, ...]:
    s, d = spec.schedule, spec.head_dim
    qk, pv = plan.mma_choice("QK"), plan.mma_choice("PV")
    out = []
    for name, rows, k, mma, major, storage in (
        ("Q", s.tile_m, d, qk, qk.a_major, "smem (TMA, once per Q tile)"),
        ("K", s.tile_n, d, qk, qk.b_major, "smem (TMA ring)"),
        ("P", s.tile_m, s.tile_n, pv, pv.a_major, "tmem (inside its stage's S columns)" if pv.a_source == "tmem"
         else "smem (one swizzled K-major tile per query stage, written by the softmax warps)"),
        ("V", d, s.tile_n, pv, pv.b_major, "smem (TMA ring)"),
    ):
        f = spec.operand(name)
        notes = []
        if mma.block_scaled:
            atoms = sf_atoms(rows, k, mma.sf_block)
            layout = (f"tcgen05 scale-factor atom 32x4x4 ({f.scale.value if f.scale else mma.sf_dtype}); "
                      f"K{SF_ATOM_BLOCKS * mma.sf_block} per atom; {atoms} atom(s) = "
                      f"{atoms * SF_ATOM_COLS} TMEM columns per {rows}x{k} tile, "
                      + ("written by the softmax warps (tcgen05.st)" if name == "P" else "copied with tcgen05.cp"))
            if name in ("Q", "K"):
                notes.append("scales folded offline (MSE rule) into the K64 layout the MMA consumes")
        elif f.format.is_fp8 and f.granularity is ScaleGranularity.BLOCK:
            layout = f"one fp32 per {f.block} tokens x head_dim (per (batch, head)); applied to S in registers"
        elif f.format.is_fp8:
            layout = {"tensor": "one fp32 per (batch, head), applied to S (Q, K) or O (P, V) in registers",
                      "token": "one fp32 per token, applied to S rows/columns in registers",
                      "none": "unscaled"}.get(f.granularity.value, f.granularity.value)
        else:
            layout = "none"
        if name == "P":
            by = {PKind.DIRECT_P: f"softmax warps (Direct-P {spec.p_production.policy.value}: scores -> E2M1 codes "
                                  f"+ E8M0 block exponents, no exp on the fast path)",
                  PKind.TWO_LEVEL: "softmax warps (two-level: row rescale to [0, 448*6], then nvfp4)",
                  PKind.EXP: "softmax warps (exp2, then convert)"}[spec.p_production.kind]
            if mma.block_scaled:
                notes.append("block scales of all blocks are written with publish part 1 (one 32-bit word "
                             "per row holds the 4 scales of a K128 atom)")
        elif name == "V" and f.format.is_fp4:
            by = "offline/host quantizer (V^T, K-major: packed fp4 operands are K-major only)"
        else:
            by = "offline/host quantizer" if not f.format.is_high_precision else "none (input dtype)"
        gran = _granularity(f)
        if f.format.is_fp8 and f.granularity is ScaleGranularity.BLOCK and not mma.block_scaled:
            gran = "token_block"
        out.append(OperandContract(name, f.format.value, f.format.bits, f.block if mma.block_scaled else None,
                                   (f.scale.value if f.scale else mma.sf_dtype) if mma.block_scaled
                                   else (f.scale.value if f.scale else None),
                                   gran, layout, major, storage, by, tuple(notes)))
    return tuple(out)


def _sm90(spec: KernelSpec, plan: KernelPlan) -> tuple[OperandContract, ...]:
    out = []
    for name in ("Q", "K", "P", "V"):
        f = spec.operand(name)
        mma = plan.mma_choice("QK" if name in ("Q", "K") else "PV")
        major = mma.a_major if name in ("Q", "P") else mma.b_major
        notes = []
        gran = _granularity(f)
        if f.format.is_fp8:
            if f.granularity is ScaleGranularity.BLOCK:
                # On Hopper a "block" of Q/K is a run of tokens sharing one fp32 scale (SageAttention
                # style): it multiplies a whole rectangle of S, which wgmma cannot do per d-block.
                gran = "token_block"
                layout = f"one fp32 per {f.block} tokens x head_dim (per (batch, head)); applied to S in registers"
            elif f.granularity is ScaleGranularity.TOKEN:
                layout = "one fp32 per token; applied to S rows/columns in registers"
            elif f.granularity is ScaleGranularity.TENSOR:
                layout = "one fp32 per (batch, head); applied to S (Q, K) or O (P, V) in registers"
            else:
                layout = "unscaled"
        else:
            layout = "none"
        storage = {"Q": "smem (TMA)", "K": "smem (TMA ring)", "V": "smem (TMA ring)", "P": "registers (wgmma A operand)"}[name]
        if name == "V" and f.format.is_fp8:
            storage = "smem (TMA ring), stored transposed D x S"
            by = "offline/host quantizer writes V^T (fp8 wgmma B must be K-major)"
        elif name == "P":
            by = {PKind.DIRECT_P: "consumer warpgroups (Direct-P: scores -> fp8 codes with FMA/ALU, no MUFU)",
                  PKind.EXP: "consumer warpgroups (exp2 on MUFU, then convert)",
                  PKind.TWO_LEVEL: "consumer warpgroups"}[spec.p_production.kind]
            if f.format.is_fp8:
                notes.append("fp8 P in registers is permuted to the wgmma A-fragment layout (byte shuffles)")
        else:
            by = "offline/host quantizer" if not f.format.is_high_precision else "none (input dtype)"
        out.append(OperandContract(name, f.format.value, f.format.bits, None,
                                   f.scale.value if (f.scale and f.format.is_fp8) else None,
                                   gran, layout, major, storage, by, tuple(notes)))
    return tuple(out)


def _reference(spec: KernelSpec) -> tuple[OperandContract, ...]:
    out = []
    for name in ("Q", "K", "P", "V"):
        f = spec.operand(name)
        by = "reference emulation (torch)" if name == "P" else (
            "offline/host quantizer" if not f.format.is_high_precision else "none (input dtype)")
        out.append(OperandContract(name, f.format.value, f.format.bits, f.block,
                                   f.scale.value if f.scale else None, _granularity(f),
                                   "as the spec says (emulated exactly)", "any", "global", by))
    return tuple(out)


def plan_contracts(plan: KernelPlan) -> KernelPlan:
    spec = plan.spec
    if spec.target is Target.SM100A:
        cs = _sm100(spec, plan)
    elif spec.target is Target.SM90A:
        cs = _sm90(spec, plan)
    else:
        cs = _reference(spec)
    o = spec.o
    cs = cs + (OperandContract("O", o.format.value, o.format.bits, None, None, "none", "none", "row-major (B, S, H, D)",
                               "global (via smem, TMA store)" if spec.target is not Target.REFERENCE else "global",
                               "epilogue (O / l, converted)"),)
    return replace(plan, contracts=cs)
