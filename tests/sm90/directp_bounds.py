"""FP8 Direct-P's LSE against the reference: a per-row bound from an error model of the S MMA.

Why a flat |dLSE| bound does not fit this recipe. P's FP8 code is rne(clamp(8 x + 120, 0, 120))
(x = t - m, log2 units): a score moved by e moves 8 x by 8 e, and a code within 8 |e| of a
rounding boundary changes by one step, a factor 2^(1/16..1/8) on that term (the E4M3 grid is
piecewise linear: 1/15..1/8 relative). The kernel's scores come from the FP8 wgmma, which
accumulates with ~13 fraction bits (``FP8_S_EPS`` below); the reference's from an fp32 product.
So a few codes per row differ. In a long row these flips are many small ones of both signs; in
a row whose l is held by a few terms (few visible keys, or large logits) one flip of a term
worth half of l moves l by ~4 % and the LSE by ~0.04 nats: the session-5 H200 misses
(docs/numerics.md, "FP8 Direct-P: the LSE bound"). Every other term keeps its code exactly, so
the only other change is the row max itself (the reference of every code), shifted by the max
key's own error.

``lse_bound`` computes, per row, from the reference's own quantities (its scores t, its
tile-by-tile running maxima m_k, hence every term's code and weight in l, and the 2-norm of
each score's products, which sets the size of that score's MMA error), a bound on |LSE_kernel
- LSE_ref| that the error model exceeds with probability < ~1e-9 per row:

- each score's error e_j ~ N(0, sigma_j^2), sigma_j = FP8_S_EPS * T_j, T_j the 2-norm of the
  products of the dot (log2 units, times the softcap's 1 - tanh^2) - the rms model of
  ``tests/sm90_bwd/bwd_modules.fp8_cancellation_bounds``, with an eps measured for the score
  MMA (``measure``);
- the row max moves by s, |s| <= K_SIGMA * max_j sigma_j; for each s (a grid, taken as
  intervals so that the bound holds between grid points), term j's code goes up one step with
  probability Q((s + d_up_j / 8) / sigma_j) and down with Q((d_dn_j / 8 - s) / sigma_j)
  (d: its distance in code units to the rounding boundary above / below), independently;
- the sums U (of the upward steps) and D (downward) are bounded above and below by Chernoff's
  inequality (each bound wrong with probability 2^-30), over the live terms (within K_SIGMA
  sigma + |s| of a boundary);
- then LSE_kernel - LSE_ref lies in [log2((2^s (l_k + U_lo - D_hi) + l_sink) / l),
  log2((2^s (l_k + U_hi - D_lo) + l_sink) / l)] (l_k the keys' part of l, l_sink a sink's), in
  nats times ln 2, plus ABS_FLOOR.

It stays tight in long rows: many flips of ~1/N of l each, whose sum concentrates, and a row max
shift s is paid back by the codes it moves (the bounds on U and D are taken at that s):
``tests/sm90/test_directp_lse_bound.py`` plants a dropped key, l off by one code step and a
row max off by one tile against it.

Measure (CPU, the reference plus ``mma_e8m13``, the e8m13 model of the FP8 wgmma):
``python tests/sm90/directp_bounds.py`` (docs/numerics.md, section 15).
"""
from __future__ import annotations

import math
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import plans  # noqa: E402,F401  (a plain checkout's package mapping)
from fp4gen.numerics import directp as dp  # noqa: E402
from fp4gen.numerics import masking, reference  # noqa: E402
from fp4gen.numerics.formats import E4M3, decode  # noqa: E402

LN2 = math.log(2.0)
# rms error of an FP8 wgmma score per unit of ``_dot_norms``: the e8m13 model measures
# 2^-14.4 (d 64) .. 2^-13.6 (d 256), largest errors 2^-11.3 .. 2^-10.7 (``measure``; heavier-
# tailed than a Gaussian). 2^-12 makes the bound's K_SIGMA-sigma reach (2^-9.4) 2.5x the
# largest error the model made, for what the model does not know of the
# hardware (it is not a transcription; DeepSeek-V3's "around 14 bits" is its 1 + 13).
FP8_S_EPS = 2.0 ** -12
FP8_MMA_K = 32  # products per k-step of an 8-bit wgmma
K_SIGMA = 6.0  # |e| <= 6 sigma: Q(6) = 1e-9 per score
CHERNOFF_L = 30 * LN2  # each bound on U, D is wrong with probability <= 2^-30
S_GRID = 8  # intervals of the row-max shift in [-K sigma, K sigma]
# other differences, none from the codes: l summed in another fp32 order (or as P @ ones on the
# tensor cores, whose e8m13 accumulation is exact for the 4-bit code values down to 2^-10 of
# l and loses < 2^-13 l per k-step below), ex2.approx of the rescale factor (2^-22 relative)
ABS_FLOOR = 2e-4  # nats


def _q(z: torch.Tensor) -> torch.Tensor:
    """Upper tail of the standard normal, P(N(0, 1) > z)."""
    return 0.5 * torch.erfc(z / math.sqrt(2.0))


def _dot_norms(st, r0: int, r1: int) -> torch.Tensor:
    """T (B, H, r, Sk) in log2 units (float64): the size of what each score's FP8 MMA
    truncates, sqrt(sum over k-steps of (the step's products' 2-norm^2 + the accumulator's
    square before it)). The accumulator enters because each step aligns to the largest of its
    products and the accumulator: the large scores, which hold l, have the large errors
    (the 2-norm of the products alone underestimates them by up to 2^1.3 at d 256)."""
    q = st.q[:, :, r0:r1].double()
    k = st.k.double()
    tot = torch.zeros(q.shape[:-1] + (k.shape[-2],), dtype=torch.float64, device=q.device)
    acc = torch.zeros_like(tot)
    for k0 in range(0, q.shape[-1], FP8_MMA_K):
        qs, ks = q[..., k0:k0 + FP8_MMA_K], k[..., k0:k0 + FP8_MMA_K]
        tot += qs.square() @ ks.square().transpose(-1, -2) + acc.square()
        acc += qs @ ks.transpose(-1, -2)
    sq = st.sq[:, :, r0:r1, None].double() if st.sq is not None else 1.0
    sk = st.sk[:, :, None, :].double() if st.sk is not None else 1.0
    return tot.sqrt() * (sq * sk) * st.c


def _scores(st, r0: int, r1: int, mma=None) -> torch.Tensor:
    """log2-unit scores of rows r0:r1 against every key (masked -inf), as ``_Prepared.scores``;
    ``mma(a, b)``: the product a @ b to use instead of torch's (an MMA model)."""
    if mma is None:  # the reference's own products, tile by tile (a wider matmul may sum in
        # another order: one ulp moves a code at a rounding tie)
        t = torch.full((st.B, st.H, r1 - r0, st.Sk), float("-inf"), device=st.device)
        for c0 in st.key_tiles(r0, r1):
            c1 = min(st.Sk, c0 + st.tile_n)
            t[..., c0:c1] = st.scores(r0, r1, c0, c1)
        return t
    dot = mma(st.q[:, :, r0:r1], st.k.transpose(-1, -2))
    sq = st.sq[:, :, r0:r1, None] if st.sq is not None else 1.0
    sk = st.sk[:, :, None, :] if st.sk is not None else 1.0
    t = dot * ((sq * sk) * st.c)
    if st.cap2:
        t = st.cap2 * torch.tanh(t / st.cap2)
    if st.masked:
        rows = torch.arange(r0, r1, device=st.device)
        cols = torch.arange(st.Sk, device=st.device)
        t = t.masked_fill(~masking.allowed(rows, cols, st.Sq, st.Sk, st.window), float("-inf"))
    return t


def row_terms(t: torch.Tensor, tile_n: int, sink_t=None) -> dict:
    """The reference's Direct-P quantities of rows of scores t (..., Sk), log2 units, masked
    -inf, keys in tiles of ``tile_n`` in ascending order (the reference's and the kernels'
    online softmax): ``m_k`` (..., Sk) the running max each key's code was taken against,
    ``u`` = 8 (t - m_k) + 120 unclamped, ``code``, ``w`` the weight of one unit of code value
    in l (2^(m_k - m) / 256), ``l_keys``, ``l_sink``, ``l`` (in units of 2^m, m the final
    reference) and ``lse2`` (log2 units, -inf for a row that sees nothing). float64 except
    the codes, which are the reference's own (``directp.fp8_direct_p_codes`` on fp32 x)."""
    sk = t.shape[-1]
    nt = -(-sk // tile_n)
    pad = nt * tile_n - sk
    tp = torch.nn.functional.pad(t, (0, pad), value=float("-inf")) if pad else t
    tmax = tp.reshape(*t.shape[:-1], nt, tile_n).amax(-1)
    m_run = torch.cummax(tmax, dim=-1).values  # the running max after each tile
    m_run = torch.where(torch.isneginf(m_run), torch.zeros_like(m_run), m_run)  # as m_new_s
    m_k = m_run.repeat_interleave(tile_n, dim=-1)[..., :sk]
    x = t - m_k  # fp32, as the reference codes it
    code = dp.fp8_direct_p_codes(x)
    val = decode(code, E4M3).double()
    m = m_run[..., -1].double()
    m_fin = m
    if sink_t is not None:
        m_fin = torch.maximum(m, sink_t.double())
    w = torch.exp2(m_k.double() - m_fin[..., None]) / 256.0
    l_keys = (val * w).sum(-1)
    l_sink = torch.exp2(sink_t.double() - m_fin) if sink_t is not None else torch.zeros_like(m)
    l = l_keys + l_sink
    empty = l == 0
    lse2 = torch.where(empty, torch.full_like(l, float("-inf")), m_fin + torch.log2(torch.where(empty, 1.0, l)))
    u = 8.0 * x.double() + 120.0
    return dict(m_k=m_k, u=u, code=code, val=val, w=w, l_keys=l_keys, l_sink=l_sink, l=l, lse2=lse2)


def _step_up(code: torch.Tensor) -> torch.Tensor:
    """Value of code + 1 minus value of code (0 at the top code 120: it cannot go up)."""
    c = code.long()
    nxt = torch.clamp(c + 1, max=120).to(torch.uint8)
    return decode(nxt, E4M3).double() - decode(code, E4M3).double()


def _step_dn(code: torch.Tensor) -> torch.Tensor:
    c = code.long()
    prv = torch.clamp(c - 1, min=0).to(torch.uint8)
    return decode(code, E4M3).double() - decode(prv, E4M3).double()


# Chernoff's bound is taken at these lambda (times 1 / l of the row): from few-key rows
# (steps ~ l / 10) to 1000-key rows (steps ~ l / 10^4); a factor 4 apart
_LAMBDAS = 4.0 ** torch.arange(0, 12, dtype=torch.float64)


def _chernoff(pi, b, row, n_rows, l, L):
    """High-probability bounds per row on S = sum_j B_j b_j, B_j ~ Bernoulli(pi_j) independent,
    b_j >= 0, over the flat terms of each row (``row``: each term's row index; ``l`` the row's
    scale): (lower, upper), each wrong with probability <= e^-L. Chernoff:
    P(S >= a) <= exp(-lam a) prod_j (1 + pi_j (e^(lam b_j) - 1)), minimised over lam, which
    treats a rare large step and many small ones each as they are (a Bernstein bound would pay
    the largest step L/3 times). The upper bound is capped by the sum of all the row's b_j."""
    z = torch.zeros(n_rows, dtype=torch.float64, device=pi.device)
    cap = z.index_add(0, row, b)
    hi = cap.clone()
    lo = torch.zeros_like(cap)
    # log E[e^(+-lam X_j)] = log(1 - pi + pi e^(+-lam b)), as a logaddexp (pi = 0 or 1, large lam b)
    log_q, log_p = torch.log1p(-pi), torch.log(pi)
    for g in _LAMBDAS.tolist():
        lam = g / l  # (n_rows,)
        lb = lam[row] * b
        up = z.index_add(0, row, torch.logaddexp(log_q, log_p + lb))
        hi = torch.minimum(hi, (L + up) / lam)
        dn = z.index_add(0, row, torch.logaddexp(log_q, log_p - lb))
        lo = torch.maximum(lo, -(L + dn) / lam)
    return torch.minimum(lo, cap), hi


def bound_from_terms(terms: dict, sigma: torch.Tensor, eps_scale: float = 1.0) -> torch.Tensor:
    """|dLSE| bound (nats) per row from ``row_terms`` and each score's error rms ``sigma``
    (log2 units, same shape as the scores; any value where masked). 0 for empty rows.

    Only the live terms enter the sums: those within K_SIGMA sigma_j + |s| of a boundary; any
    other one flips only if its own error exceeds K_SIGMA sigma_j (probability 2e-9 each)."""
    code, u, w, l = terms["code"], terms["u"], terms["w"], terms["l"]
    shape = l.shape
    n = u.shape[-1]
    code, u, w = code.reshape(-1, n), u.reshape(-1, n), w.reshape(-1, n)
    l_k, l_s, l = terms["l_keys"].reshape(-1), terms["l_sink"].reshape(-1), l.reshape(-1)
    vis = torch.isfinite(u)
    sig = torch.where(vis, sigma.reshape(-1, n).double() * eps_scale, torch.zeros_like(u))
    e_m = K_SIGMA * sig.amax(-1)  # the row max moves by at most the largest score error
    c = code.double()
    reach = e_m[:, None] + K_SIGMA * sig
    d_up = (c + 0.5 - u) / 8.0  # how far x must rise (log2 units) for the code to go up
    d_dn = (u - c + 0.5) / 8.0
    live_up = vis & (code < 120) & (d_up < reach)
    live_dn = vis & (code > 0) & (d_dn < reach)
    ru, ju = live_up.nonzero(as_tuple=True)
    rd, jd = live_dn.nonzero(as_tuple=True)
    du, dd = d_up[ru, ju], d_dn[rd, jd]
    su, sd = sig[ru, ju].clamp_min(1e-30), sig[rd, jd].clamp_min(1e-30)
    bu = _step_up(code[ru, ju]) * w[ru, ju]
    bd = _step_dn(code[rd, jd]) * w[rd, jd]
    R = l.numel()
    safe_l = torch.where(l > 0, l, torch.ones_like(l))
    worst = torch.zeros_like(l)
    grid = torch.linspace(-1.0, 1.0, S_GRID + 1, dtype=torch.float64, device=u.device)
    # U, D (the steps up and down) at every shift s of the grid: (lower, upper) bounds
    U = [_chernoff(_q((g * e_m[ru] + du) / su), bu, ru, R, safe_l, CHERNOFF_L) for g in grid.tolist()]
    D = [_chernoff(_q((dd - g * e_m[rd]) / sd), bd, rd, R, safe_l, CHERNOFF_L) for g in grid.tolist()]
    for i in range(S_GRID):
        s_a, s_b = grid[i] * e_m, grid[i + 1] * e_m
        # on [s_a, s_b] the up-flips are likeliest at s_a, the down-flips at s_b (and the
        # fewest of each at the other end): the net change of l is in [U_lo - D_hi, U_hi - D_lo]
        hi = torch.log2((torch.exp2(s_b) * (l_k + U[i][1] - D[i][0]) + l_s) / safe_l)
        lo_arg = (torch.exp2(s_a) * (l_k + U[i + 1][0] - D[i + 1][1]).clamp_min(0) + l_s) / safe_l
        lo = torch.log2(lo_arg.clamp_min(1e-300))
        worst = torch.maximum(worst, torch.maximum(hi, -lo))
    return torch.where(l > 0, worst * LN2 + ABS_FLOOR, torch.zeros_like(l)).reshape(shape)


def e8m13_rowsum(x: torch.Tensor, k_step: int = FP8_MMA_K, frac_bits: int = 13) -> torch.Tensor:
    """sum(x, -1) as an FP8 wgmma with a ones operand accumulates it (``l_from_mma``: l = P @ 1
    over the whole row, the accumulator carried across key tiles): per k-step the accumulator
    and the step's terms, aligned to the largest, truncated to ``frac_bits`` below it (the
    e8m13 model, as ``test_bwd_host_fp8.mma_e8m13``). x >= 0, float64."""
    acc = torch.zeros(x.shape[:-1], dtype=torch.float64, device=x.device)
    for k0 in range(0, x.shape[-1], k_step):
        terms = torch.cat([acc[..., None], x[..., k0:k0 + k_step]], -1)
        _, e = torch.frexp(terms.amax(-1, keepdim=True))
        quantum = torch.ldexp(torch.ones_like(terms[..., :1]), e - 1 - frac_bits)
        acc = (torch.trunc(terms / quantum) * quantum).sum(-1)
    return acc


def l_from_mma_allowance(terms: dict, factor: float = 2.0) -> torch.Tensor:
    """Extra |dLSE| (nats) for a kernel whose l comes from the tensor cores: the e8m13 model
    truncates every small code value toward zero, so l comes out low, by ~1 % in 1000-key
    rows at x1 logits (most terms are ~2^-10.5 of l and lose their last mantissa bit; measured
    on the CPU, docs/numerics.md section 15). ``factor`` x the model's loss, one-sided, taken
    from the reference's own values (in the final row reference's units)."""
    vals = terms["val"] * terms["w"]
    vals = torch.where(torch.isfinite(terms["u"]), vals, torch.zeros_like(vals))
    loss = (terms["l_keys"] - e8m13_rowsum(vals)).clamp_min(0.0)
    l = terms["l"]
    frac = torch.where(l > 0, factor * loss / torch.where(l > 0, l, torch.ones_like(l)), torch.zeros_like(l))
    return -torch.log1p(-frac.clamp(max=0.5))


def _sink_t(sinks, st, r):
    if sinks is None:
        return None
    return (sinks.to(torch.float32) * dp.LOG2E)[None, :, None].expand(st.B, st.H, r)


def lse_bound(q, k, v, spec, sinks=None, eps_scale: float = 1.0, row_chunk=None,
              check_ref_lse=None, l_from_mma: bool = False) -> torch.Tensor:
    """Per-row |dLSE| bound (B, H, Sq) in nats for an FP8 Direct-P kernel against
    ``reference.forward(q, k, v, spec, sinks=sinks)`` (0 where the row sees nothing).
    ``eps_scale`` multiplies FP8_S_EPS (a what-if). ``check_ref_lse``: the reference's LSE;
    when given, the recomputed quantities are checked against it (they must be the same row
    sums, or the bound is about something else). ``l_from_mma``: the plan's l = P @ 1 on the
    tensor cores (``l_from_mma_allowance`` is added)."""
    from fp4gen.ir.spec import Format, PKind

    if spec.p_production.kind is not PKind.DIRECT_P or spec.p.format is not Format.FP8E4M3:
        raise ValueError(f"lse_bound is for FP8 Direct-P specs (P : fp8e4m3 via direct_p), not {spec.name!r}")
    st = reference._Prepared(q, k, v, spec)
    if row_chunk is None:  # the reference's row chunks: its products, shape for shape
        row_chunk = reference._row_chunk(st.B, st.H, st.tile_n, st.D)
    out = torch.zeros(st.B, st.H, st.Sq, dtype=torch.float64, device=st.device)
    lse_mine = torch.empty_like(out)
    for r0 in range(0, st.Sq, row_chunk):
        r1 = min(st.Sq, r0 + row_chunk)
        t = _scores(st, r0, r1)
        terms = row_terms(t, st.tile_n, _sink_t(sinks, st, r1 - r0))
        sigma = FP8_S_EPS * _dot_norms(st, r0, r1)
        if st.cap2:  # d/dt of cap2 tanh(t / cap2) = 1 - tanh^2 = 1 - (t / cap2)^2 on the capped t
            sigma = sigma * (1.0 - (t.double() / st.cap2).square()).clamp(0.0, 1.0)
        out[:, :, r0:r1] = bound_from_terms(terms, sigma, eps_scale)
        if l_from_mma:
            out[:, :, r0:r1] += l_from_mma_allowance(terms)
        lse_mine[:, :, r0:r1] = terms["lse2"] * LN2
    if check_ref_lse is not None:
        ref = check_ref_lse.to(torch.float64)
        fin = torch.isfinite(ref)
        same_inf = torch.equal(fin, torch.isfinite(lse_mine))
        diff = (lse_mine[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
        if not same_inf or diff > 1e-4:
            raise AssertionError(f"lse_bound's recomputation is not the reference's LSE (max diff {diff:.2e})")
    return out.to(torch.float32)


def check_lse(lse, lse_ref, bound, slack: float = 0.0, what: str = "") -> None:
    """|lse - lse_ref| <= bound + slack on every finite reference row (the -inf rows are
    ``_check``'s business), with the worst row in the message."""
    fin = ~torch.isneginf(lse_ref)
    if not fin.any():
        return
    dl = (lse.float() - lse_ref.float()).abs()
    lim = bound.to(dl.device).float() + slack
    bad = fin & ~(dl <= lim)
    if bad.any():
        ex = torch.where(fin, dl - lim, torch.full_like(dl, -float("inf")))
        i = int(ex.flatten().argmax())
        idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), dl.shape))
        raise AssertionError(f"{what}: |dLSE| {dl[idx].item():.3e} > error-model bound {lim[idx].item():.3e} "
                             f"at (b, h, row) {idx}; {int(bad.sum())} rows over, max |dLSE| {dl[fin].max().item():.3e}")


def check_directp_lse(lse, lse_ref, inputs, slack: float = 0.0, what: str = "", l_from_mma: bool = False) -> None:
    """The sm90 GPU tests' FP8 Direct-P LSE check: ``inputs`` = (q, k, v, spec) or (q, k, v,
    spec, sinks), exactly what the reference was given; |dLSE| <= lse_bound + slack per row
    (``l_from_mma``: the plan's, see ``lse_bound``)."""
    if inputs is None:
        raise ValueError(f"{what}: an FP8 Direct-P LSE check needs the inputs (q, k, v, spec[, sinks]) "
                         "for its error-model bound")
    q, k, v, spec, *rest = inputs
    sinks = rest[0] if rest else None
    bound = lse_bound(q, k, v, spec, sinks, check_ref_lse=lse_ref, l_from_mma=l_from_mma)
    check_lse(lse, lse_ref, bound, slack, what)


# ------------------------------------------------------------- measuring -----

def _kernel_model_lse(q, k, v, spec, sinks=None, row_chunk=128):
    """LSE (B, H, Sq) nats of the reference's Direct-P with S from ``mma_e8m13`` (the FP8 wgmma
    model), and the rms of its score error over T (the model's eps), from the same inputs."""
    sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "sm90_bwd"))
    from test_bwd_host_fp8 import mma_e8m13

    st = reference._Prepared(q, k, v, spec)
    lse = torch.empty(st.B, st.H, st.Sq, dtype=torch.float64)
    se2, sn, zmax = 0.0, 0, 0.0
    for r0 in range(0, st.Sq, row_chunk):
        r1 = min(st.Sq, r0 + row_chunk)
        t0 = _scores(st, r0, r1)
        t1 = _scores(st, r0, r1, mma=mma_e8m13)
        vis = torch.isfinite(t0)
        T = _dot_norms(st, r0, r1)
        z = ((t1.double() - t0.double()) / T)[vis]
        se2 += z.square().sum().item()
        sn += z.numel()
        zmax = max(zmax, z.abs().max().item() if z.numel() else 0.0)
        lse[:, :, r0:r1] = row_terms(t1, st.tile_n, _sink_t(sinks, st, r1 - r0))["lse2"] * LN2
    return lse, math.sqrt(se2 / max(sn, 1)), zmax


def _keys_seen(st):
    rows = torch.arange(st.Sq)
    return masking.allowed(rows, torch.arange(st.Sk), st.Sq, st.Sk, st.window).sum(-1)


def measure(cases, seeds=range(3)):
    """For each (d, causal, (B, Sq, Sk, H, Hkv, mult), sinks) case and seed (CPU generator, the
    tests' shapes and statistics; the GPU tests' CUDA streams cannot be replayed here): the
    e8m13 model's eps, its max |dLSE| against the reference, the rows' key counts there, the
    flat bound's misses and the error-model bound's."""
    sys.path.insert(0, _HERE)
    from plans import make_plan

    rows = []
    for d, causal, (B, Sq, Sk, H, Hkv, mult), sinks in cases:
        spec = make_plan("fp8_directp", d, causal, sinks=sinks is not None).spec
        for seed in seeds:
            g = torch.Generator().manual_seed(seed * 1000 + Sq * 7 + Sk + d)
            q = (torch.randn(B, Sq, H, d, generator=g) * mult).bfloat16()
            k = torch.randn(B, Sk, Hkv, d, generator=g).bfloat16()
            v = torch.randn(B, Sk, Hkv, d, generator=g).bfloat16()
            sk_ = None if sinks is None else torch.linspace(-4.0, 12.0, H) * mult
            _, lse_ref = reference.forward(q, k, v, spec, sinks=sk_)
            lse_k, eps, zmax = _kernel_model_lse(q, k, v, spec, sk_)
            bound = lse_bound(q, k, v, spec, sk_, check_ref_lse=lse_ref).double()
            fin = torch.isfinite(lse_ref)
            dl = torch.where(fin, (lse_k - lse_ref.double()).abs(), torch.zeros_like(lse_k))
            flat = 1.5e-2 + 1e-3 * lse_ref.double().abs()
            st = reference._Prepared(q, k, v, spec)
            nk = _keys_seen(st)[None, None].expand_as(dl)
            i = int(dl.flatten().argmax())
            rows.append(dict(d=d, causal=causal, shape=(B, Sq, Sk, H, Hkv), mult=mult, sinks=sinks is not None,
                             seed=seed, eps_log2=round(math.log2(eps), 2), err_max_log2=round(math.log2(zmax), 2),
                             max_dlse=dl.max().item(),
                             keys_at_max=int(nk.flatten()[i]), lse_at_max=lse_ref.flatten()[i].item(),
                             flat_miss=int((fin & (dl > flat)).sum()), model_miss=int((fin & (dl > bound)).sum()),
                             bound_at_max=bound.flatten()[i].item(),
                             bound_long=bound[fin & (nk >= 512)].median().item() if (fin & (nk >= 512)).any()
                             else float("nan"),
                             max_ratio=(dl / bound.clamp_min(1e-12))[fin].max().item()))
            print(rows[-1], flush=True)
    return rows


MEASURE_CASES = [
    (96, True, (1, 513, 513, 2, 2, 8.0), None),  # test_head_dims_gpu's d96 miss
    (256, True, (1, 700, 300, 4, 1, 1.0), None),  # test_head_dims_gpu's d256 miss
    (128, True, (1, 513, 513, 4, 2, 8.0), "linspace"),  # test_varlen_sinks_gpu's std8 miss
    (128, False, (1, 1024, 1024, 2, 2, 1.0), None),  # long rows
    (128, True, (1, 513, 513, 2, 2, 12.0), None),  # test_sm90_gpu's large logits
]

if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2, help="seeds per case (the long-row case: one)")
    a = ap.parse_args()
    for case in MEASURE_CASES:
        measure([case], range(1 if case[2][1] >= 1024 else a.seeds))
