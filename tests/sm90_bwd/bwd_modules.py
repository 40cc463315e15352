"""Backward test helpers shared by the CPU tests, the GPU tests and ``run_on_device.py``.

``make_spec`` builds a Hopper spec with a ``backward`` block; ``load_module`` plans it,
renders forward + backward into one file (as the generated module will be) and imports it.
Also the float64 autograd check and error statistics.
"""
from __future__ import annotations

import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _shim_plain_checkout():
    """On a plain checkout (the device machine: nothing pip-installed) register pyproject's
    package mapping (ir/ -> fp4gen.ir, ...) by hand."""
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    from fp4gen.runtime.srctree import use_source_tree

    use_source_tree(_ROOT)


_shim_plain_checkout()

from fp4gen.ir.spec import Backward, KernelSpec, Mask, Target  # noqa: E402

# (head_dim, causal, deterministic): every template variant
VARIANTS = [(d, c, det) for d in (128, 64) for c in (True, False) for det in (False, True)]


# the FP8 backward: S from the forward's FP8 Q/K (reuse q k), dP and dV with FP8 dO, V, P
FP8_SPEC = """
attention {name} {{
  target sm90a
  head_dim {d}
  mask {mask}
  Q : fp8e4m3(block=128)
  K : fp8e4m3(block=128)
  P : fp8e4m3 via exp
  V : fp8e4m3(scale=tensor)
  schedule {{ tile 128 x 128 }}
  backward {{
    reuse q k lse
    dO : {do}{ds}
    deterministic {det}
  }}
}}
"""


def make_spec(head_dim=128, causal=True, deterministic=False, fp8=False) -> KernelSpec:
    """``fp8``: False (bf16 backward), True (FP8 S, dP, dV), "s" (FP8 S only, bf16 dO) or "ds"
    (FP8 S, dP, dV and dS: every MMA in FP8)."""
    tag = {False: "bf16", True: "fp8", "s": "fp8s", "ds": "fp8ds"}[fp8]
    name = f"sm90_bwd_{tag}_d{head_dim}{'_causal' if causal else ''}{'_det' if deterministic else ''}"
    if fp8:
        from fp4gen.frontend import parse_text

        text = FP8_SPEC.format(name=name, d=head_dim, mask="causal" if causal else "none",
                               do="bf16" if fp8 == "s" else "fp8e4m3",
                               ds="\n    dS : fp8e4m3" if fp8 == "ds" else "", det=str(deterministic).lower())
        return parse_text(text, f"{name}.attn")[0]
    return KernelSpec(name=name, target=Target.SM90A, head_dim=head_dim,
                      mask=Mask.CAUSAL if causal else Mask.NONE,
                      backward=Backward(deterministic=deterministic))


# a backward with ``mask window(l, r)`` and/or ``softcap c`` for each recipe: BF16 (every MMA in
# bf16), "fp8" (FP8 S, dP, dV: the training recipe), "ds8" (every MMA in FP8)
MASKED_SPEC = """
attention {name} {{
  target sm90a
  head_dim {d}
  mask {mask}{softcap}
  Q : {qk}
  K : {qk}
  P : {p}
  V : {v}
  O : bf16
  schedule {{ tile 128 x 128 }}
  backward {{
    reuse q k lse{grads}
    deterministic {det}
  }}
}}
"""
RECIPES = {
    "bf16": dict(qk="bf16", p="bf16", v="bf16", grads=""),
    "fp8": dict(qk="fp8e4m3(block=128)", p="fp8e4m3 via exp", v="fp8e4m3(scale=tensor)",
                grads="\n    dO : fp8e4m3"),
    "ds8": dict(qk="fp8e4m3(block=128)", p="fp8e4m3 via exp", v="fp8e4m3(scale=tensor)",
                grads="\n    dO : fp8e4m3\n    dS : fp8e4m3"),
}


def make_masked_spec(recipe="bf16", head_dim=128, window=None, softcap=0.0, causal=False,
                     deterministic=False) -> KernelSpec:
    """A backward spec of ``recipe`` (RECIPES) with ``window`` (left, right) or mask causal /
    none, and ``softcap`` (0: none)."""
    from fp4gen.frontend import parse_text

    mask = f"window({window[0]}, {window[1]})" if window is not None else ("causal" if causal else "none")
    tag = "" if window is None else f"_w{window[0]}_{window[1]}".replace("-", "m")
    name = (f"sm90_bwd_{recipe}_d{head_dim}{tag}{'_causal' if causal else ''}"
            f"{f'_cap{softcap:g}' if softcap else ''}{'_det' if deterministic else ''}")
    text = MASKED_SPEC.format(name=name, d=head_dim, mask=mask, softcap=f"\n  softcap {softcap:g}" if softcap else "",
                              det=str(deterministic).lower(), **RECIPES[recipe])
    return parse_text(text, f"{name}.attn")[0]


def make_plan(head_dim=128, causal=True, deterministic=False, fp8=False):
    from fp4gen.ir.passes import plan_kernel

    return plan_kernel(make_spec(head_dim, causal, deterministic, fp8))


def render_module(plan) -> str:
    from fp4gen.lowering.sm90 import render
    from fp4gen.lowering.sm90_bwd import render_backward

    src = render(plan)
    if "_BWD_HOST = " not in src:  # the forward renderer appends it itself when the plan has one
        src += "\n\n" + render_backward(plan)
    return src


def load_module(plan, directory: str):
    """Render ``plan`` (forward + backward) into ``directory`` and import it."""
    path = os.path.join(directory, f"{plan.spec.name}.py")
    with open(path, "w") as f:
        f.write(render_module(plan))
    spec = importlib.util.spec_from_file_location(f"_sm90bwd_{plan.spec.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ checking

def _scores(qf, kf, causal, scale, window=None, softcap=0.0):
    """Scaled scores (B, H, Sq, Sk), capped by ``softcap`` and masked (causal, or ``window``:
    fp4gen.numerics.masking's rules, the oracle's)."""
    import torch

    from fp4gen.numerics import masking

    Sq, Sk = qf.shape[2], kf.shape[2]
    s = masking.softcap((qf @ kf.transpose(-1, -2)) * scale, softcap)
    if window is None:
        window = (-1, 0) if causal else masking.NO_WINDOW
    if masking.is_masked(window):
        ok = masking.allowed(torch.arange(Sq, device=qf.device), torch.arange(Sk, device=qf.device), Sq, Sk, window)
        s = s.masked_fill(~ok, float("-inf"))
    return s


def torch_forward(q, k, v, causal, scale, window=None, softcap=0.0):
    """Exact-ish (fp32) attention forward: o (bf16) and lse (B, H, Sq) natural log.
    Rows with no visible key get o = 0, lse = -inf (the kernels' convention)."""
    import torch

    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    qf = q.float().permute(0, 2, 1, 3)
    kf = k.float().repeat_interleave(g, dim=2).permute(0, 2, 1, 3)
    vf = v.float().repeat_interleave(g, dim=2).permute(0, 2, 1, 3)
    s = _scores(qf, kf, causal, scale, window, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)[..., None])
    o = (p @ vf).permute(0, 2, 1, 3)
    return o.to(q.dtype).contiguous(), lse.contiguous()


def autograd_f64(q, k, v, do, causal, scale, window=None, softcap=0.0):
    """dq, dk, dv by float64 autograd of softmax attention (GQA by repeat), with the mask
    (causal or ``window``) and ``softcap`` of fp4gen.numerics.masking."""
    import torch

    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    kk = k64.repeat_interleave(g, dim=2).permute(0, 2, 1, 3)
    vv = v64.repeat_interleave(g, dim=2).permute(0, 2, 1, 3)
    s = _scores(q64.permute(0, 2, 1, 3), kk, causal, scale, window, softcap)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows with no visible key
    o = (p @ vv).permute(0, 2, 1, 3)
    o.backward(do.double())
    return q64.grad, k64.grad, v64.grad


def rel_l2(x, ref, floor_rms: float = 1e-4) -> float:
    """||x - ref|| / ||ref||, with ||ref|| floored at an RMS of ``floor_rms``: gradients that
    are zero up to rounding (e.g. dq when every query sees one key) are compared absolutely."""
    x, ref = x.double(), ref.double()
    n = max(ref.norm().item(), floor_rms * max(ref.numel(), 1) ** 0.5)
    return (x - ref).norm().item() / n


def all_finite(*xs) -> bool:
    return all(bool(x.isfinite().all()) for x in xs)


# name -> (B, Sq, Sk, H, Hkv, logit multiplier on q)
CASES = {
    "basic": (2, 256, 256, 4, 4, 1.0),
    "ragged_200": (1, 200, 200, 2, 2, 1.0),
    "s1": (1, 1, 1, 2, 2, 1.0),
    "sq100_sk300": (1, 100, 300, 2, 2, 1.0),
    "sq300_sk100": (1, 300, 100, 2, 2, 1.0),  # causal: the first 200 queries see no key
    "gqa_6_2": (1, 256, 256, 6, 2, 1.0),
    "large_logits": (1, 256, 256, 2, 2, 24.0),  # near one-hot rows: exp under/overflow paths
    "long_1000": (1, 1000, 1000, 2, 1, 1.0),
}
# kernel vs the numerics oracle run with dP in fp32: the kernel keeps dP^T in fp32 registers
# (it never feeds an MMA), so that is the oracle of its arithmetic; P and dS are rounded to
# bf16 by both. What remains is accumulation order and ex2.approx.
TOL_ORACLE = 1e-2
# FP8 variants (FP8 S, dP, dV): 2^8 P and dO are rounded to e4m3 by kernel and oracle alike,
# but from fp32 values that differ in the last bits (ex2.approx, FMA contraction), so a value
# near a rounding boundary can land one e4m3 step (1/8 to 1/16 of it) apart. Near-one-hot
# rows (large_logits) concentrate dV on a few such values; a single query (S=1) makes
# dS = P (dP - D) pure cancellation. Measured on the H200: <= 2e-3 on random inputs, 1.3e-2
# on large logits, 3.8e-2 at S=1 (where both are compared at the rel_l2 floor). A layout or
# scale bug shows as O(1) (the 2^8 scale once missing: 2.6e2).
TOL_ORACLE_FP8 = 5e-2
# kernel vs float64 autograd: at most this factor worse than the oracle itself, + slack
F64_FACTOR, F64_SLACK = 2.0, 5e-3


def make_inputs(case, d, seed=0, device="cuda"):
    import torch

    B, Sq, Sk, H, Hkv, mult = CASES[case]
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(B, Sq, H, d, generator=g) * mult).to(torch.bfloat16)
    k = torch.randn(B, Sk, Hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(B, Sk, Hkv, d, generator=g).to(torch.bfloat16)
    do = torch.randn(B, Sq, H, d, generator=g).to(torch.bfloat16)
    return [x.to(device) for x in (q, k, v, do)]


def check_case(mod, spec, case, seed=0, device="cuda"):
    """Run the kernel's backward on one case; returns a dict of errors and pass/fail."""
    import torch

    from fp4gen.numerics import reference

    causal = spec.mask is Mask.CAUSAL
    q, k, v, do = make_inputs(case, spec.head_dim, seed, device)
    scale = spec.scale
    fp8_fwd = spec.q.format.value.startswith("fp8")
    if fp8_fwd:
        # the quantized forward's own O and LSE (the state a training step would hand over)
        ro, rlse = reference.forward(q, k, v, spec)
        o, lse = ro.to(torch.bfloat16), rlse.float()
    else:
        o, lse = torch_forward(q, k, v, causal, scale)
    dq, dk, dv = mod.backward(q, k, v, o, lse, do)
    if q.is_cuda:
        torch.cuda.synchronize()
    import dataclasses

    from fp4gen.ir.spec import Format, OperandFormat

    bw = spec.backward
    fmts = dict(bw.formats)
    fmts["dP"] = OperandFormat(Format.FP32)
    spec_o = dataclasses.replace(spec, backward=dataclasses.replace(bw, formats=fmts))
    rq, rk, rv = reference.backward(q, k, v, o, lse, do, spec_o)
    fq, fk, fv = autograd_f64(q, k, v, do, causal, scale)
    row = {"case": case, "d": spec.head_dim, "causal": causal, "fp8": fp8_fwd,
           "deterministic": spec.backward.deterministic, "finite": all_finite(dq, dk, dv)}
    ok = row["finite"]
    for name, x, r, f in (("dq", dq, rq, fq), ("dk", dk, rk, fk), ("dv", dv, rv, fv)):
        e_ref, e_f64, e_orc = rel_l2(x, r), rel_l2(x, f), rel_l2(r, f)
        row[name] = {"vs_oracle": e_ref, "vs_f64": e_f64, "oracle_vs_f64": e_orc}
        ok = ok and e_ref <= (TOL_ORACLE_FP8 if fp8_fwd else TOL_ORACLE) and e_f64 <= F64_FACTOR * e_orc + F64_SLACK
    if causal and case == "sq300_sk100":
        # queries that see no key have exactly zero gradient
        Sq, Sk = q.shape[1], k.shape[1]
        empty = dq[:, : Sq - Sk]
        row["empty_rows_zero"] = bool((empty == 0).all())
        ok = ok and row["empty_rows_zero"]
    row["pass"] = bool(ok)
    if not ok:
        row["diag"] = diagnose((dq, dk, dv), (rq, rk, rv))
    return row


# tanh.approx.f32's largest relative error (PTX ISA), the softcap's one approximation
TANH_APPROX_REL_ERR = 2.0 ** -10.987


def softcap_slacks(q, k, v, do, scale, window, causal, softcap):
    """What ``tanh.approx`` may add to the rel-L2 errors of (dq, dk, dv) under ``softcap``
    c (0: nothing), from the error model, not from any kernel output: a capped score
    c tanh(s / c) moves by at most c e (e = TANH_APPROX_REL_ERR), so P by a factor up to
    1 +- c e (dV: c e); dS = P (dP - D) g with g = 1 - tanh^2 moves by P (dP - D) (c e g + 2 e),
    so dQ, dK by c e + 2 e ||P (dP - D)|| / ||P (dP - D) g|| (float64, from the inputs)."""
    import torch

    if not softcap:
        return 0.0, 0.0, 0.0
    e = TANH_APPROX_REL_ERR
    B, Sq, H, D = q.shape
    g_ = H // k.shape[2]
    qd = q.double().permute(0, 2, 1, 3)
    kd = k.double().repeat_interleave(g_, dim=2).permute(0, 2, 1, 3)
    vd = v.double().repeat_interleave(g_, dim=2).permute(0, 2, 1, 3)
    dod = do.double().permute(0, 2, 1, 3)
    s = _scores(qd, kd, causal, scale, window, softcap)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    o = p @ vd
    dp = dod @ vd.transpose(-1, -2)
    t = p * (dp - (dod * o).sum(-1, keepdim=True))
    g = torch.where(torch.isfinite(s), 1.0 - (s / softcap) ** 2, torch.zeros_like(s))
    ratio = t.norm().item() / max((t * g).norm().item(), 1e-300)
    qk = softcap * e + 2 * e * ratio
    return qk, qk, softcap * e


# The FP8 recipes' cancellation bound (``fp8_cancellation_bounds``). Hopper's FP8 wgmma keeps
# its accumulator to 13 fraction bits: per k-step (32 products) the products and the
# accumulator are aligned to the largest exponent among them and truncated there (public
# analyses of H100 FP8 GEMMs; ``test_bwd_host_fp8.mma_e8m13`` models it). Each product loses
# < 2^-13 of that largest term, with the product's sign (truncation toward zero), so the
# errors of a dot product add like random ones: its rms is taken as at most FP8_ACC_EPS times
# the 2-norm of its terms, sqrt(sum_k a_k^2 b_k^2). The model gives 2^-13.1 on the dS of
# window(0, 0) (test_fp8_window_cancellation.py); 2^-9 leaves a factor 16 for the hardware.
FP8_ACC_EPS = 2.0 ** -9
# the largest spacing of a format's grid relative to the value it rounds (normal numbers)
_FORMAT_STEP = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10, "fp32": 0.0, "fp8e4m3": 2.0 ** -3, "fp8e5m2": 2.0 ** -2}


def _recipe_fp8(spec):
    """(S from FP8 Q/K, FP8 dO: dP and dV FP8, FP8 dS: dQ and dK FP8) of a backward spec."""
    bw = spec.backward
    s_fp8 = spec.q.format.value.startswith("fp8") and {"q", "k"} <= set(bw.reuse)
    return s_fp8, bw.format_of("dO").format.value.startswith("fp8"), bw.format_of("dS").format.value.startswith("fp8")


def fp8_cancellation_bounds(q, k, v, do, spec, window, causal, softcap):
    """Bounds (Frobenius norms, float64 from the inputs) on how far an FP8 recipe's dq, dk, dv
    may be from the oracle's because its FP8 MMAs accumulate with 13 fraction bits where the
    oracle uses fp32: (0, 0, 0) for a recipe without FP8 MMAs.

    Why: dS = P (dP - D) cancels (sum_j P_ij (dP_ij - D_i) = 0), and where it cancels
    completely, e.g. under window(0, 0) (every query sees one key: P = 1, O = V_j, exact dq =
    dk = 0), the oracle's dq and dk are rounding noise (O in bf16 against the FP8 V that dP
    sees) and the kernel's are that plus its MMAs' error, as large: a tolerance relative to
    the oracle's noise cannot judge them. The error model (e = FP8_ACC_EPS, entrywise from
    the bf16 inputs; ``a . b`` a dot product of rms error <= e sqrt(sum a^2 b^2)):

    - dP^T (FP8 dO, V): dP_ij moves by e A_ij, A = sqrt(dO^2 (V^2)^T), so dS by P_ij e A_ij;
    - S^T (FP8 Q, K): the log2 score by e T_ij, T = sqrt(Q^2 (K^2)^T) scale log2 e, so P by
      P ln 2 e T_ij and dS by that times |dP - D| (a softcap's 1 - tanh^2 <= 1 only shrinks it);
    - dS rounded to its format (step u of the value: bf16 2^-7, e4m3 2^-3) moves by one step
      where the moved value crosses a grid point, with probability |d dS| / step: an expected
      square of |d dS| u (|dS| + |d dS|);
    - FP8 dS: dQ = dS K and dK = dS^T Q in FP8 add e sqrt(dS^2 K^2) and e sqrt((dS^2)^T Q^2);
      FP8 dV = P^T dO adds e sqrt((P^2)^T dO^2).

    The errors of different entries are independent, so dq's bound is
    scale ||sqrt(E^2 K^2 + R K^2 + e^2 dS^2 K^2)|| (E: the dS moves, R: the rounding term),
    dk's the same with Q (summed over a GQA group). ``check_masked`` takes max(tol ||oracle||,
    bound): where dS does not cancel the bound is far below the relative tolerance (0.7 % of
    ||dq|| for FP8, 2.3 % for all-FP8 at window(255, 0), 256 tokens, against 5 %) and the check
    is the old one; where it cancels the bound decides, and a real bug (a wrong window edge, a wrong scale) is still O(|dP| |K|) off
    (``test_fp8_window_cancellation.py`` plants one)."""
    import math

    import torch

    s_fp8, do_fp8, ds_fp8 = _recipe_fp8(spec)
    if not (s_fp8 or do_fp8 or ds_fp8):
        return 0.0, 0.0, 0.0
    e = FP8_ACC_EPS
    B, Sq, H, D = q.shape
    g_ = H // k.shape[2]
    scale = spec.scale
    qd = q.double().permute(0, 2, 1, 3)
    kd = k.double().repeat_interleave(g_, dim=2).permute(0, 2, 1, 3)
    vd = v.double().repeat_interleave(g_, dim=2).permute(0, 2, 1, 3)
    dod = do.double().permute(0, 2, 1, 3)
    s = _scores(qd, kd, causal, scale, window, softcap)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    dpd = (dod @ vd.transpose(-1, -2) - (dod * (p @ vd)).sum(-1, keepdim=True)).abs()
    ds = p * dpd
    err = torch.zeros_like(p)
    if do_fp8:
        err += p * e * (dod.square() @ vd.square().transpose(-1, -2)).sqrt()
    if s_fp8:
        t = (qd.square() @ kd.square().transpose(-1, -2)).sqrt() * (scale * math.log2(math.e))
        err += p * math.log(2.0) * e * t * dpd
    u = _FORMAT_STEP[spec.backward.format_of("dS").format.value]
    sq_q = (err.square() + err * u * (ds + err)) @ kd.square()  # (B, H, Sq, D): expected squares
    sq_k = (err.square() + err * u * (ds + err)).transpose(-1, -2) @ qd.square()  # (B, H, Sk, D)
    if ds_fp8:
        sq_q = sq_q + e * e * ((ds + err).square() @ kd.square())
        sq_k = sq_k + e * e * ((ds + err).square().transpose(-1, -2) @ qd.square())
    sq_v = e * e * (p.square().transpose(-1, -2) @ dod.square()) if do_fp8 else torch.zeros_like(vd)

    def group_norm(x):  # expected squares per query head -> the norm of the GQA group's sum
        return x.reshape(B, H // g_, g_, x.shape[2], D).sum(2).sum().sqrt().item()

    return scale * sq_q.sum().sqrt().item(), scale * group_norm(sq_k), group_norm(sq_v)


def check_masked(mod, spec, shape, mult=1.0, seed=0, device="cuda"):
    """The kernel's backward of a spec with a window and/or softcap (``make_masked_spec``) on
    inputs of ``shape`` (B, Sq, Sk, H, Hkv), q and k times ``mult``, against the numerics oracle
    (reference.backward with dP in fp32, from the reference forward's O and LSE) and float64
    autograd; as ``check_case``, plus ``softcap_slacks``. Rows that see no key must get exactly
    zero dq.

    Per gradient x (oracle r, float64 autograd f, norms floored as ``rel_l2``):
    ||x - r|| <= max((tol + softcap slack) ||r||, B) and ||x - f|| <= max((F64_FACTOR ||r - f|| /
    ||f|| + F64_SLACK + slack) ||f||, ||r - f|| + B), B from ``fp8_cancellation_bounds`` (0 for
    BF16): the FP8 recipes' gradients that cancel to ~0 (window(0, 0)) are judged by the FP8
    MMAs' error model instead of relative to noise. Each gradient's entry in the returned row
    has the measured errors and the bounds they were held to (``describe`` prints them)."""
    import dataclasses

    import torch

    from fp4gen.ir.spec import Format, OperandFormat
    from fp4gen.numerics import masking, reference

    B, Sq, Sk, H, Hkv = shape
    d = spec.head_dim
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(B, Sq, H, d, generator=gen) * mult).to(torch.bfloat16).to(device)
    k = (torch.randn(B, Sk, Hkv, d, generator=gen) * mult).to(torch.bfloat16).to(device)
    v = torch.randn(B, Sk, Hkv, d, generator=gen).to(torch.bfloat16).to(device)
    do = torch.randn(B, Sq, H, d, generator=gen).to(torch.bfloat16).to(device)
    window = tuple(spec.window_size) if spec.mask is Mask.WINDOW else None
    causal = spec.mask is Mask.CAUSAL
    softcap = float(spec.softcap or 0.0)
    ro, rlse = reference.forward(q, k, v, spec)
    o, lse = ro.to(torch.bfloat16), rlse.float()
    dq, dk, dv = mod.backward(q, k, v, o, lse, do)
    if q.is_cuda:
        torch.cuda.synchronize()
    bw = spec.backward
    fmts = dict(bw.formats)
    fmts["dP"] = OperandFormat(Format.FP32)
    spec_o = dataclasses.replace(spec, backward=dataclasses.replace(bw, formats=fmts))
    rq, rk, rv = reference.backward(q, k, v, o, lse, do, spec_o)
    fq, fk, fv = autograd_f64(q, k, v, do, causal, spec.scale, window, softcap)
    slacks = softcap_slacks(q, k, v, do, spec.scale, window, causal, softcap)
    bounds = fp8_cancellation_bounds(q, k, v, do, spec, window, causal, softcap)
    fp8 = spec.q.format.value.startswith("fp8")
    tol = TOL_ORACLE_FP8 if fp8 else TOL_ORACLE
    row = {"shape": shape, "mult": mult, "window": window, "causal": causal, "softcap": softcap,
           "recipe": spec.name, "finite": all_finite(dq, dk, dv)}
    ok = row["finite"]
    for name, x, r, f, sl, b in (("dq", dq, rq, fq, slacks[0], bounds[0]), ("dk", dk, rk, fk, slacks[1], bounds[1]),
                                 ("dv", dv, rv, fv, slacks[2], bounds[2])):
        e_ref, e_f64, e_orc = rel_l2(x, r), rel_l2(x, f), rel_l2(r, f)
        n_r, n_f = _floored_norm(r), _floored_norm(f)
        err_r, err_f = e_ref * n_r, e_f64 * n_f
        lim_r = max((tol + sl) * n_r, b)
        lim_f = max((F64_FACTOR * e_orc + F64_SLACK + sl) * n_f, e_orc * n_f + b)
        row[name] = {"vs_oracle": e_ref, "vs_f64": e_f64, "oracle_vs_f64": e_orc, "softcap_slack": sl,
                     "err_oracle": err_r, "limit_oracle": lim_r, "err_f64": err_f, "limit_f64": lim_f,
                     "fp8_bound": b, "norm_oracle": n_r}
        ok = ok and err_r <= lim_r and err_f <= lim_f
    # rows that see no key (the oracle's rule): exactly zero dq
    w = window if window is not None else ((-1, 0) if causal else masking.NO_WINDOW)
    vis = masking.allowed(torch.arange(Sq), torch.arange(Sk), Sq, Sk, w)
    seen, seen_k = vis.any(1).to(dq.device), vis.any(0).to(dq.device)
    if not bool(seen.all()):
        row["empty_rows_zero"] = bool((dq[:, ~seen] == 0).all())
        ok = ok and row["empty_rows_zero"]
    if not bool(seen_k.all()):  # keys no query sees (a CTA whose query-tile range may be empty)
        row["unseen_keys_zero"] = bool((dk[:, ~seen_k] == 0).all() and (dv[:, ~seen_k] == 0).all())
        ok = ok and row["unseen_keys_zero"]
    row["pass"] = bool(ok)
    if not ok:
        row["diag"] = diagnose((dq, dk, dv), (rq, rk, rv))
    return row


def _floored_norm(ref, floor_rms: float = 1e-4) -> float:
    """``rel_l2``'s denominator."""
    return max(ref.double().norm().item(), floor_rms * max(ref.numel(), 1) ** 0.5)


def describe(row) -> str:
    """A ``check_masked`` row as the assertion message: per gradient the measured errors
    against the oracle and float64 autograd and the bounds they were held to."""
    parts = [f"{row['recipe']} shape {row['shape']} mult {row['mult']} window {row['window']} "
             f"softcap {row['softcap']}: {'pass' if row['pass'] else 'FAIL'}"]
    for name in ("dq", "dk", "dv"):
        g = row[name]
        parts.append(f"{name}: |x - oracle| {g['err_oracle']:.3e} <= {g['limit_oracle']:.3e} "
                     f"(rel {g['vs_oracle']:.3e}, |oracle| {g['norm_oracle']:.3e}, fp8 bound {g['fp8_bound']:.3e}); "
                     f"|x - f64| {g['err_f64']:.3e} <= {g['limit_f64']:.3e}")
    for key in ("finite", "empty_rows_zero", "unseen_keys_zero"):
        if key in row and not row[key]:
            parts.append(f"{key}: False")
    if "diag" in row:
        parts.append(f"diag: {row['diag']}")
    return "\n  ".join(parts)


def diagnose(got, ref, tile_q=64, tile_k=128):
    """Where a failing gradient is wrong: rel-L2 per query tile (dq) / key tile (dk, dv),
    over all batches and heads, and whether NaNs appear. Tells a wrong mask or tile range
    (a few tiles off) from a wrong layout (everything off) from a wrong stage (dv right,
    dk/dq wrong: dS; dk right, dq wrong: the dS SMEM tile or the dQ MMA)."""
    out = {}
    for name, x, r, t in (("dq", got[0], ref[0], tile_q), ("dk", got[1], ref[1], tile_k),
                          ("dv", got[2], ref[2], tile_k)):
        S = r.shape[1]
        out[name] = {
            "nan": int(x.isnan().sum()),
            "tiles": [round(rel_l2(x[:, i:i + t], r[:, i:i + t]), 4) for i in range(0, S, t)][:64],
        }
    return out


def oracle_tile_scales(monkeypatch, args):
    """``reference.backward(*args)`` and the FP8 dS scale c of every tile it rounds, in the
    order it picks them (``fp8_ds_tile_scale`` is called once per visited tile; with one row
    chunk that is the kernel's walk: key tile outer, query tiles ascending)."""
    from fp4gen.numerics import reference as R

    seen, pick = [], R.fp8_ds_tile_scale

    def record(a_sq, c_guess, first):
        c, c_next = pick(a_sq, c_guess, first)
        seen.append(c)
        return c, c_next

    monkeypatch.setattr(R, "fp8_ds_tile_scale", record)
    try:
        out = R.backward(*args)
    finally:
        monkeypatch.setattr(R, "fp8_ds_tile_scale", pick)
    return out, seen
