"""Outlier-robust transforms of attention inputs, as plain numerics (issue 21).

Each transform changes what the quantizers see, not the attention it computes (exactly, in
real arithmetic), so that one scale per (batch, head) or per block fits the data better:

- ``smooth_k``: K minus its mean over tokens, per (batch, kv head) (SageAttention's K
  smoothing). q . (k_j - m) = q . k_j - q . m: the subtracted term is the same for every
  key of a row, so softmax and O are unchanged; the LSE drops by scale * q . m
  (``lse_shift`` puts it back). Not invariant under softcap (tanh is not a shift) or with
  sink logits (the sink does not move with the keys): ``apply`` refuses both.
- ``channel_scale_v``: V's columns divided by a power of two per (batch, kv head, channel),
  c = 2**ceil(log2 amax over tokens) (1 for an all-zero channel), so every channel's amax
  lies in [1/2, 1] (in [1, 2) above 2**127, where c stops at float32's largest power of two;
  below 2**-126 it is smaller: c stops at the smallest normal one); O's columns are multiplied back by c after PV (an epilogue multiply in a
  kernel). Powers of two make both steps exact in float32.
- ``hadamard``: Q and K times the same orthonormal D x D matrix H D_s / sqrt(D) (Sylvester
  Hadamard, optional random signs D_s from a seed): Q K^T is unchanged, and a channel
  outlier of K is spread over all D channels (FA3's incoherent processing). D must be a
  power of two.

- ``sink_tokens``: the first n keys of every sequence (attention sinks: a token that holds a
  large share of every row's softmax mass, often with a small value row) are left out of the
  quantized attention and attended exactly in float32 outside it; ``Post.apply`` merges the two
  by their log-sum-exps (as split-KV attention merges its splits), which is exact: the kernel
  on keys n.. gives O' = sum_{j>=n} e^{s_j} v_j / e^{LSE'}. Bottom-right masks are unchanged by
  dropping leading keys (every bound is relative to the diagonal), so causal and windowed
  kernels still see the right keys; the n exact keys get the mask and softcap themselves. Why:
  a sink's small value row shares an FP4 V block (32 keys per channel) with larger ones and
  loses its precision there, at half of each row's weight (docs/numerics.md section 14).
  Backward (``SinkTokens.grads`` and ``Post.kernel_frame``): the attention's backward on keys n..
  is given the merged O and LSE (in its own frame) instead of its own, which makes it exact
  without an LSE gradient: P = exp(s - LSE) is then each key's share of the whole row, and
  D = rowsum(dO * O) the whole row's, as split-KV and ring attention run their splits' backwards;
  the n exact keys' share of dQ, dK, dV is computed in float32 beside it.

``apply(q, k, v, transforms)`` runs them in a fixed order and returns the transformed
inputs and a ``Post`` that maps the transformed attention's (O, LSE) back.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import masking
from .formats import pow2

# spec options K smooth, V channel_scale, rotate: their Post maps O and LSE one at a time (Post.o, Post.lse)
TRANSFORMS = ("smooth_k", "channel_scale_v", "hadamard")
# spec option ``sink_tokens N``: its Post merges O and LSE together (``Post.apply``), and its backward
# needs the merged O and LSE (``Post.kernel_frame``, ``SinkTokens.grads``): fp4gen.attention runs it as
# one autograd node (torch_ops._SinkTokensAttention), a generated module in runtime/transforms.py
SPLIT_TRANSFORMS = ("sink_tokens",)
ALL_TRANSFORMS = TRANSFORMS + SPLIT_TRANSFORMS


def smooth_k(k: torch.Tensor):
    """(k - mean over tokens, mean (B, 1, Hkv, D)) in float32, per (batch, kv head).

    The mean accumulates in float64: a float32 sum of S keys overflows once |k| >= F32_MAX / S
    (Inf or NaN from finite keys, even all-equal ones whose smoothed value is 0); the mean of
    finite values is finite in float32. k - mean stays finite while max |k| <= F32_MAX / 2
    (beyond that the exact result is not a float32; scores of such keys overflow anyway)."""
    k = k.to(torch.float32)
    m = k.mean(dim=1, keepdim=True, dtype=torch.float64).to(torch.float32)
    return k - m, m


def lse_shift(q: torch.Tensor, mean_k: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * q . mean_k per (b, h, query) (B, H, Sq) float32: what smoothing took off the LSE."""
    B, Sq, H, D = q.shape
    hk = mean_k.shape[2]
    mk = mean_k.to(torch.float32).repeat_interleave(H // hk, dim=2)  # (B, 1, H, D)
    return (q.to(torch.float32) * mk).sum(-1).transpose(1, 2) * scale


def channel_scale_v(v: torch.Tensor):
    """(v / c, c) with c (B, 1, Hkv, D) = 2**ceil(log2 amax_tokens |v|) per channel. c is a
    step function of v (zero derivative almost everywhere), so it is taken detached: autograd
    then sees v / c and o * c as the linear maps they are."""
    v = v.to(torch.float32)
    amax = v.detach().abs().amax(dim=1, keepdim=True)
    mant, ex = torch.frexp(amax)  # amax = m 2**ex, m in [0.5, 1): the cover is 2**ex (2**(ex-1) if m == 0.5)
    e = torch.where(mant == 0.5, ex - 1, ex).to(torch.int32)
    c = torch.where(amax == 0, torch.ones_like(amax), pow2(torch.clamp(e, -126, 127)))
    return v / c, c


# a constant of (d, seed): torch.compile bakes it into the graph instead of tracing the seeded
# torch.Generator, which it cannot (fp4gen.attention with `rotate qk hadamard(seed=N)`)
@torch.compiler.assume_constant_result
def hadamard_matrix(d: int, seed: Optional[int] = None) -> torch.Tensor:
    """Orthonormal (d, d) float32: Sylvester's Hadamard / sqrt(d), columns' signs flipped by a
    seeded draw when ``seed`` is given."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if seed is not None:
        s = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
        h = s[:, None].to(torch.float64) * h  # rows of H scaled: x @ (D_s H)
    return (h / d ** 0.5).to(torch.float32)


@functools.lru_cache(maxsize=32)  # bounded: a few (d, seed, device) per process; 256 KiB at d = 256
def _hadamard_cached(d: int, seed: Optional[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return hadamard_matrix(d, seed).to(device=device, dtype=dtype)


# a constant to torch.compile as well (the cached device tensor, baked into the graph)
@torch.compiler.assume_constant_result
def hadamard_on(d: int, seed: Optional[int], device: torch.device, dtype: torch.dtype = torch.float32):
    """``hadamard_matrix(d, seed)`` on ``device`` as ``dtype``, built and copied once per key (not a
    CPU build and a blocking copy per call); shared between callers: never modify it."""
    return _hadamard_cached(d, seed, torch.device(device), dtype)


def hadamard(q: torch.Tensor, k: torch.Tensor, seed: Optional[int] = None):
    """(q R, k R) for the orthonormal R of ``hadamard_matrix``, in float32. Finite while
    max |x| <= F32_MAX / sqrt(D): every entry of x R, and every partial sum of it, is at most
    ||x||_2 <= sqrt(D) max |x|."""
    r = hadamard_on(q.shape[-1], seed, q.device, torch.float32)
    return q.to(torch.float32) @ r, k.to(torch.float32) @ r


@dataclass
class SinkTokens:
    """The keys ``sink_tokens`` took out of the attention, and what attends them exactly."""

    q: torch.Tensor  # (B, Sq, H, D) the original queries
    k: torch.Tensor  # (B, n, Hkv, D) float32, the original first n keys
    v: torch.Tensor  # (B, n, Hkv, D) float32
    sk: int  # the original key count (for the mask)
    scale: float
    softcap: float = 0.0
    window: tuple = masking.NO_WINDOW

    def _scores(self, q, k, v, dev):
        """(t, k, v): the sink keys' scores (B, H, Sq, n) float32, scaled, capped and masked (-inf),
        and k, v repeated to the query heads (GQA), for queries ``q`` (B, Sq, H, D)."""
        Sq, H = q.shape[1], q.shape[2]
        g = H // k.shape[2]
        k, v = (x.repeat_interleave(g, dim=2).to(dev) for x in (k, v))
        s = torch.einsum("bqhd,bnhd->bhqn", q.to(device=dev, dtype=torch.float32), k) * self.scale
        s = masking.softcap(s, self.softcap)
        if masking.is_masked(self.window):
            n = k.shape[1]
            ok = masking.allowed(torch.arange(Sq, device=dev), torch.arange(n, device=dev), Sq, self.sk, self.window)
            s = s.masked_fill(~ok, float("-inf"))
        return s, k, v

    def merge(self, o: torch.Tensor, lse: torch.Tensor):
        """(O, LSE) over all keys from the attention's (o, lse) over keys n.. (float32)."""
        dev = o.device
        s, k, v = self._scores(self.q, self.k, self.v, dev)
        lse = lse.to(torch.float32)
        m = torch.maximum(lse, s.amax(-1))  # (B, H, Sq)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # a row that sees no key at all
        wk = torch.exp(lse - m)  # the attention's share (0 where it saw no key: lse -inf)
        ws = torch.exp(s - m[..., None])  # (B, H, Sq, n)
        den = wk + ws.sum(-1)
        num = o.to(torch.float32) * wk.transpose(1, 2)[..., None] + torch.einsum("bhqn,bnhd->bqhd", ws, v)
        safe = torch.where(den > 0, den, torch.ones_like(den))
        o2 = torch.where((den > 0).transpose(1, 2)[..., None], num / safe.transpose(1, 2)[..., None],
                         torch.zeros_like(num))
        lse2 = torch.where(den > 0, m + torch.log(safe), torch.full_like(m, float("-inf")))
        return o2, lse2

    def grads(self, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor):
        """(dq, dk, dv, dlse) float32: the n exact keys' share of the attention's gradient, given
        the merged (O, LSE) over all keys (``merge``'s) and dO: dv_j = sum_i P_ij dO_i, dS_ij =
        P_ij (dO_i . v_j - D_i) with P_ij = exp(s_ij - LSE_i) and D_i = rowsum(dO_i * O_i), through
        softcap and the scale to q (B, Sq, H, D) and k (B, n, Hkv, D) (summed over each GQA
        group). With the attention's own backward on keys n.. given the same O and LSE
        (``Post.kernel_frame``), the sum is the gradient of attention over all keys (the LSE, as
        the op's, carries none). ``dlse`` (B, H, Sq): dL/d(LSE of the attention over keys n..),
        the merge's only other input: adding c_i to it adds c_i to each of those keys' scores, so
        it is the sum of their dS, and as every row's dS sums to 0, minus the exact keys' sum. A
        shift the merge adds to that LSE (smoothing's ``lse_shift``) takes it (the shift depends
        on q and K's mean: with sink_tokens it is not a constant of the merged O)."""
        dev = o.device
        q = self.q.detach().to(device=dev, dtype=torch.float32)
        t, kh, vh = self._scores(q, self.k.detach(), self.v.detach(), dev)  # (B, H, Sq, n); kh, vh per query head
        lse = lse.detach().to(torch.float32)
        lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)  # no key at all: P = 0
        p = torch.exp(t - lse[..., None])  # each exact key's share of the whole row (0 where masked)
        dof = do.detach().to(torch.float32)
        drow = (dof * o.detach().to(torch.float32)).sum(-1).transpose(1, 2)  # D_i (B, H, Sq)
        dt = p * (torch.einsum("bqhd,bnhd->bhqn", dof, vh) - drow[..., None])  # dL/d(capped score)
        ds = dt * masking.softcap_grad(t, self.softcap) if self.softcap else dt
        B, n, hkv, D = self.k.shape
        g = q.shape[2] // hkv
        dq = torch.einsum("bhqn,bnhd->bqhd", ds, kh) * self.scale
        dk = (torch.einsum("bhqn,bqhd->bnhd", ds, q) * self.scale).reshape(B, n, hkv, g, D).sum(3)
        dv = torch.einsum("bhqn,bqhd->bnhd", p, dof).reshape(B, n, hkv, g, D).sum(3)
        return dq, dk, dv, -dt.sum(-1)


@dataclass
class Post:
    """What maps the transformed attention's outputs back to the original's."""

    v_scale: Optional[torch.Tensor] = None  # (B, 1, Hkv, D)
    lse_add: Optional[torch.Tensor] = None  # (B, H, Sq)
    sinks: Optional[SinkTokens] = None  # sink_tokens: merged by ``apply`` (needs O and LSE together)

    def _one_at_a_time(self):
        if self.sinks is not None:
            raise ValueError("sink_tokens merges O and LSE together: use Post.apply(o, lse)")

    def o(self, o: torch.Tensor) -> torch.Tensor:
        self._one_at_a_time()
        return self._o(o)

    def lse(self, lse: torch.Tensor) -> torch.Tensor:
        self._one_at_a_time()
        return self._lse(lse)

    def _o(self, o):
        if self.v_scale is None:
            return o
        H, hk = o.shape[2], self.v_scale.shape[2]
        return o * self.v_scale.repeat_interleave(H // hk, dim=2).to(o.device)

    def _lse(self, lse):
        return lse if self.lse_add is None else lse + self.lse_add.to(lse.device)

    def apply(self, o: torch.Tensor, lse: torch.Tensor):
        """(O, LSE) of the original attention: V's scales back on O, the smoothing shift back on
        the LSE (both now over keys n.. in the original frame), then the sink tokens merged."""
        o, lse = self._o(o), self._lse(lse)
        return (o, lse) if self.sinks is None else self.sinks.merge(o, lse)

    def kernel_frame(self, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor):
        """(o', lse', do') for the transformed attention's backward from the original attention's
        O, LSE (``apply``'s outputs) and dO: O / c and dO * c (O = O' c: exact, c a power of two),
        LSE minus the smoothing shift; o' and do' in o's and do's dtypes. With sink_tokens these
        are the merged O and LSE over all keys, not the attention's own over keys n..: its
        backward then computes each key's P against the whole row's LSE and D = rowsum(dO' * o')
        over the whole row, which is the exact gradient for keys n.. (``SinkTokens.grads`` adds
        the exact keys' share)."""
        c = self._o(torch.ones_like(o, dtype=torch.float32))  # O's column scales (1 without channel_scale)
        o2 = (o.to(torch.float32) / c).to(o.dtype)
        do2 = (do.to(torch.float32) * c).to(do.dtype)
        lse2 = lse - self._lse(torch.zeros_like(lse))
        return o2, lse2, do2


def apply(q, k, v, transforms: Sequence[str], scale: float, *, softcap: float = 0.0,
          sinks=None, hadamard_seed: Optional[int] = None, sink_tokens: int = 1,
          window=masking.NO_WINDOW):
    """(q', k', v', Post) with ``transforms`` (a subset of ALL_TRANSFORMS) applied in the order
    sink_tokens (the first ``sink_tokens`` keys split off, so that the others' mean and channel
    scales do not see them), smooth_k, hadamard, channel_scale_v (the mean of K R is the mean of
    K times R, so the order of those two does not matter; V is independent). ``window``: the
    attention's mask (FlashAttention window sizes), which the exactly attended sink keys need."""
    bad = [t for t in transforms if t not in ALL_TRANSFORMS]
    if bad:
        raise ValueError(f"unknown transform(s) {', '.join(bad)}: use {', '.join(ALL_TRANSFORMS)}")
    post = Post()
    if "sink_tokens" in transforms:
        n = sink_tokens
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n < k.shape[1]:
            raise ValueError(f"sink_tokens: n must be an int in 1..{k.shape[1] - 1} (fewer than the "
                             f"{k.shape[1]} keys), got {n!r}")
        post.sinks = SinkTokens(q, k[:, :n].to(torch.float32), v[:, :n].to(torch.float32), k.shape[1],
                                scale, softcap, tuple(window))
        k, v = k[:, n:], v[:, n:]
    if "smooth_k" in transforms:
        if softcap:
            raise ValueError("smooth_k changes the scores by a per-row constant, which softcap's tanh "
                             "does not ignore: the attention would change")
        if sinks is not None:
            raise ValueError("smooth_k shifts every key's logit but not the sink's: the attention would change")
        k, mean = smooth_k(k)
        post.lse_add = lse_shift(q, mean, scale)
    if "hadamard" in transforms:
        q, k = hadamard(q, k, hadamard_seed)
    if "channel_scale_v" in transforms:
        v, c = channel_scale_v(v)
        post.v_scale = c
    return q, k, v, post
