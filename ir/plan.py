"""The plan-level IR: every decision the planner made, ready for lowering.

``KernelPlan`` is produced by ``fp4gen.ir.passes.plan_kernel(spec)``. Templates
receive a finished plan and nothing else: any choice a generated kernel makes
must be recorded here first.

Target-specific sections: ``tmem`` exists only for sm100a; ``sm90`` only for
sm90a. The reference target has neither.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .spec import KernelSpec


@dataclass(frozen=True)
class Sm90Plan:
    """Register/SMEM ownership for the Hopper warp-specialized forward.

    One producer warp(group) issues TMA loads of Q, K, V; ``consumer_warpgroups``
    warpgroups each own ``tile_m // consumer_warpgroups`` query rows (a wgmma
    M-mode is 64 rows per warpgroup), keep S and O in registers, and run the
    online softmax.
    """

    tile_m: int
    tile_n: int
    consumer_warpgroups: int
    kv_stages: int
    # FP8 wgmma needs both operands K-major, so an fp8 V is stored transposed
    # (D x S) for the PV product.
    v_transposed: bool
    # overlap the softmax of one KV tile with the QK^T of the next (FA3 style)
    intra_warpgroup_overlap: bool
    # two consumer warpgroups take turns on the tensor cores (FA3 ping-pong)
    pingpong: bool
    smem_bytes: int
    producer_registers: int
    consumer_registers: int


@dataclass(frozen=True)
class KernelPlan:
    spec: KernelSpec
    sm90: Optional[Sm90Plan] = None
    # Sections below are filled by the planning passes (see fp4gen.ir.passes).
    # Each is an immutable value defined next to the pass that builds it.
    contracts: tuple = field(default=())
    tmem: Optional[object] = None
    publish: Optional[object] = None
    pipeline: Optional[object] = None
    events: tuple = field(default=())
    cost: Optional[object] = None
