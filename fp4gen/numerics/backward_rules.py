"""The backward's numerics that the oracle and the planners share: the sm90a tile (the FP8 dS
scale granularity), FP8 dS's scale rule (``dS : fp8e4m3``) and FP8 P's fixed scale. One definition here; the
planner (ir/passes/backward.py) takes them from here and the template is rendered with them,
so the oracle never imports a compiler stage."""
from __future__ import annotations

# query rows per inner step; a wgmma M-mode is 64 rows per warpgroup, and with the
# keys as the M side of S^T, 64 queries keep S^T and dP^T at 32 registers each
BWD_TILE_M = 64
# keys per CTA: two MMA warpgroups x 64 keys
BWD_TILE_N = 128
FP8_DS_SMALL = 28.0  # 448 / 16: a tile whose max f |dS| stays below halves the next tile's scale
FP8_DS_HEADROOM = 4.0  # a scale taken from a tile's exact max is handed on times this
FP8_DS_HALVE_MIN_LOG2 = -59  # the guess is halved only from 2^-59 up: it never goes below 2^-60
# P as an FP8 E4M3 operand is e4m3(2^8 P) (forward PV and the backward's dV = P^T dO): P <= 1
# lands at <= 256 < 448, and 2^-9 P still has E4M3's smallest subnormal step
P_FP8_SCALE_LOG2 = 8
