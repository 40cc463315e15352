"""Context-parallel attention: q, k, v sharded along the sequence over a torch.distributed group.

    from fp4gen.parallel import context_parallel_attention, shard_for_cp, unshard
    q_l, k_l, v_l = (shard_for_cp(x, group) for x in (q, k, v))        # (B, S / W, H, D) each
    o_l = context_parallel_attention(q_l, k_l, v_l, group=group, spec=spec, causal=True)
    o = unshard(o_l, group)                                             # (B, S, H, D)

Two modes (the user guide is docs/parallel.md):

- ``mode="ring"``: every rank keeps its Q and passes its K/V block around the ring (isend to
  rank + 1, irecv from rank - 1; on CUDA issued on a side stream, so the next block's transfer
  runs while the current block computes). Each block runs fp4gen's own attention op
  (``torch.ops.fp4gen.attention_fwd``: the reference backend on the CPU, the generated kernel
  on a GPU) and returns its O and LSE; the partial results are merged in fp32 by the log-sum-exp
  rule. The backward runs the ring again with ``attention_bwd`` per block and the merged O/LSE;
  each block's dK/dV accumulate in fp32 and travel with the block until they are home.
- ``mode="a2a"`` (Ulysses): an all-to-all turns the sequence shards into head shards (every rank
  then holds the whole sequence for H / W heads), ``fp4gen.attention`` runs once, and the
  inverse all-to-all brings O back to sequence shards. H and Hkv must be multiples of W.

Causal load balancing (``balanced=True``, Llama 3 / TransformerEngine): the sequence is cut into
2 W chunks and rank r holds chunks r and 2 W - 1 - r (``shard_for_cp``), so every ring step
costs every rank the same half block. With an FP8 recipe (K or V FP8 in the spec), K/V travel
as the reference's FP8 payload and scales (``numerics.quant.quantize_fp8``, the spec's
granularity), half the bytes of BF16; ``last_comm_stats()`` reports the bytes per ring step.
``set_debug(True)`` records the ring's schedule (``debug_trace()``) and makes early reads of
received buffers and writes to buffers in flight observable (``_Ring``'s comment).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import torch.distributed as dist

from fp4gen import torch_ops
from fp4gen.ir.spec import Format, Layout, Mask, Sinks
from fp4gen.numerics import quant
from fp4gen.numerics.formats import decode
from fp4gen.numerics import reference as _ref
from fp4gen.torch_ops import AttentionInputError

__all__ = ["context_parallel_attention", "shard_for_cp", "unshard", "shard_indices", "last_comm_stats", "set_debug",
           "debug_trace", "MODES"]

MODES = ("ring", "a2a")
_WHO = "fp4gen.parallel.context_parallel_attention"
_STATS: dict = {}


# ---------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def shard_indices(seq_len: int, world: int, rank: int, *, balanced: bool = True) -> torch.Tensor:
    """The global sequence positions rank ``rank`` of ``world`` holds, in local order.

    balanced: 2 W chunks of S / (2 W), rank r holds chunks r and 2 W - 1 - r (so that under a
    causal mask every rank has as many visible keys as every other); else one contiguous chunk
    S / W. S must divide into the chunks."""
    n = 2 * world if balanced else world
    if seq_len % n:
        raise AttentionInputError(f"fp4gen.parallel: a sequence of {seq_len} tokens does not split into {n} equal "
                                  f"chunks ({'2 per rank, balanced' if balanced else 'one per rank'}, {world} ranks)")
    c = seq_len // n
    chunks = (rank, n - 1 - rank) if balanced else (rank,)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks])


def shard_for_cp(x: torch.Tensor, group=None, *, seq_dim: int = 1, balanced: bool = True) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor (every rank holds ``x``): the positions of
    ``shard_indices``, contiguous. Shard q, k, v (and dO, labels...) the same way."""
    world, rank = _world(group)
    idx = shard_indices(x.shape[seq_dim], world, rank, balanced=balanced).to(x.device)
    return x.index_select(seq_dim, idx).contiguous()


def unshard(x_local: torch.Tensor, group=None, *, seq_dim: int = 1, balanced: bool = True) -> torch.Tensor:
    """The full-sequence tensor from every rank's shard (an all_gather, then the positions of
    ``shard_indices`` put back in order). Not differentiable."""
    world, _ = _world(group)
    parts = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    gathered = torch.cat(parts, seq_dim)
    S = gathered.shape[seq_dim]
    order = torch.cat([shard_indices(S, world, r, balanced=balanced) for r in range(world)])
    out = torch.empty_like(gathered)
    out.index_copy_(seq_dim, order.to(x_local.device), gathered)
    return out


# ---------------------------------------------------------------------------
# Which blocks a ring step computes
# ---------------------------------------------------------------------------


def step_blocks(rank: int, src: int, world: int, n_local: int, causal: bool, balanced: bool):
    """[(q0, q1, k0, k1, causal)] in local rows: what rank ``rank`` computes against the K/V
    block of rank ``src`` (each rank holds ``n_local`` tokens). Non-causal: the whole block.
    Causal, contiguous shards: src < rank all, src == rank the causal diagonal, src > rank none.
    Causal, balanced (chunks r, 2W-1-r): src == rank the causal local block (its local order is
    the global order); src < rank every query against src's first chunk; src > rank the second
    query chunk against both of src's chunks. ``tests/parallel/test_blocks.py`` checks that the
    blocks of all steps tile the causal mask exactly."""
    full = (0, n_local, 0, n_local, False)
    if not causal:
        return [full]
    if src == rank:
        return [(0, n_local, 0, n_local, True)]
    if not balanced:
        return [full] if src < rank else []
    c = n_local // 2
    return [(0, n_local, 0, c, False)] if src < rank else [(c, n_local, 0, n_local, False)]


# ---------------------------------------------------------------------------
# What travels: K/V at input precision or as the spec's FP8 payload and scales
# ---------------------------------------------------------------------------


def _fp8_of(fmt):
    """(MiniFloat, granularity, block) of an FP8 operand format, as the reference reads it;
    None for other formats (those travel at the input's precision)."""
    if fmt.format not in _ref._FP8:
        return None
    return _ref._FP8[fmt.format], _ref._GRAN[fmt.granularity], fmt.block or 128


class _Wire:
    """One tensor's encoding on the ring: ``fp8`` None (as is) or (format, granularity, block).
    ``encode`` -> the tensors sent; ``decode`` -> the tensor the receiver's block attention reads.

    FP8: the payload codes (1 byte each) and one fp32 amax per scale group (the group's scale is
    ``quant``'s function of it, so the amax costs the scale's 4 bytes). ``decode`` rebuilds a
    tensor that the backend's own quantizer maps back to exactly these codes and this scale:
    payload x scale, and the group's amax where the code is the format's largest (the element(s)
    that set the scale). So the receiver computes what the block's owner would compute from its
    own K/V, bit for bit (``tests/parallel``), while half of BF16's bytes travel."""

    def __init__(self, fp8, dtype):
        self.fp8, self.dtype = fp8, dtype

    def encode(self, x):
        if self.fp8 is None:
            return [x.contiguous()]
        fmt, gran, block = self.fp8
        t = quant.quantize_fp8(x, gran, block, fmt)
        return [t.codes, _group_amax(x.to(torch.float32), gran, block)]

    def decode(self, bufs):
        if self.fp8 is None:
            return bufs[0]
        fmt, gran, block = self.fp8
        codes, amax = bufs
        t = quant.FP8Tensor(codes, quant._fp8_scale(amax, fmt), fmt, gran, block)
        vals = decode(codes, fmt)
        top = quant.FP8Tensor(codes, amax, fmt, gran, block).expand_scale() * torch.sign(vals)
        x = torch.where(vals.abs() == fmt.max_value, top, vals * t.expand_scale())
        return x.to(self.dtype)

    def describe(self, x) -> str:
        if self.fp8 is None:
            return str(x.dtype).replace("torch.", "")
        fmt, gran, block = self.fp8
        return f"fp8{fmt.name}({f'block={block}' if gran == 'block' else gran})"


def _group_amax(x, gran: str, block: int) -> torch.Tensor:
    """max |x| over each FP8 scale group of ``quant.quantize_fp8`` (its scale's shape)."""
    if gran == "tensor":
        return x.abs().amax((1, 3))
    if gran == "token":
        return x.abs().amax(3)
    B, S, H, D = x.shape
    xp = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, (-S) % block))
    return xp.abs().reshape(B, -1, block, H, D).amax((2, 4))


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


# ---------------------------------------------------------------------------
# Point-to-point on the ring
# ---------------------------------------------------------------------------

# Debug mode (``set_debug``; or FP4GEN_CP_DEBUG=1 in the environment): the ring records what it
# issues and computes in order (``debug_trace``), a received buffer holds NaN until its wait
# (the transfer lands in a hidden buffer, copied over at the wait, as if the data arrived at the
# last possible moment: a read before the wait shows up as NaN in the result), and a send buffer
# that changes while in flight raises. tests/parallel/test_overlap_gloo.py uses all three.
_DEBUG = {"on": os.environ.get("FP4GEN_CP_DEBUG", "") not in ("", "0"), "trace": []}
_PHASE = {0: "fwd", 1: "bwd", 2: "dkv"}  # tag -> what travels: forward K/V, backward K/V, dK/dV


def set_debug(on: bool = True) -> None:
    """Turn the ring's debug mode on or off (see above) and clear its trace."""
    _DEBUG["on"] = bool(on)
    _DEBUG["trace"].clear()


def debug_trace() -> list:
    """This process's ring events since ``set_debug``, in issue order: ("start" | "finish", phase,
    step) for a transfer (phase "fwd" / "bwd": K/V, "dkv": dK/dV) and ("compute", "fwd" | "bwd",
    step) just before a step's block kernels are issued."""
    return list(_DEBUG["trace"])


def _trace(event: str, phase: str, step: int) -> None:
    if _DEBUG["on"]:
        _DEBUG["trace"].append((event, phase, step))


def _poison(t: torch.Tensor) -> None:
    """What a debug-mode receive buffer holds before its wait: NaN (0xFF is NaN in E4M3 and E5M2)."""
    t.fill_(float("nan") if t.is_floating_point() else 255)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclasses.dataclass
class _Pending:
    """One step's transfer in flight. It holds every buffer the transfer touches, so none is
    freed (and reused by the caching allocator) before ``finish`` waited for it."""
    reqs: list
    send: list
    recv: list  # what ``finish`` returns
    land: list  # where the transfer writes: ``recv`` itself, or a hidden buffer in debug mode
    sent: Optional[list]  # debug mode: copies of ``send`` at the start
    tag: int
    step: int


class _Ring:
    """isend to the next rank and irecv from the previous one, issued before the step's block
    attention and waited after it (``start`` / ``finish``), so that the transfer of the next
    K/V block runs while the current one computes.

    CUDA ordering: ``start`` records an event on the current stream after the producers of the
    send buffers (and the allocation of the receive buffers) and issues the ops on a side stream
    that waits for that event, so NCCL (whose internal stream follows the side stream) never
    reads a buffer before it is written, and the current stream goes on with the block kernels.
    ``finish`` waits the requests (NCCL: the current stream waits the transfer) and makes the
    current stream wait the side stream; only then does anything read a received buffer. The
    buffers are ``record_stream``-ed on the side stream and kept referenced in ``_Pending``
    until the wait. On gloo the same calls are asynchronous (gloo's own threads)."""

    _side = {}

    def __init__(self, group, device):
        self.group = group
        self.world, self.rank = _world(group)
        g = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self.next, self.prev = g((self.rank + 1) % self.world), g((self.rank - 1) % self.world)
        self.cuda = device.type == "cuda"
        if self.cuda and device not in _Ring._side:
            _Ring._side[device] = torch.cuda.Stream(device)
        self.stream = _Ring._side.get(device)

    def start(self, send: list, tag: int, step: int) -> _Pending:
        debug = _DEBUG["on"]
        recv = [torch.empty_like(t) for t in send]
        land, sent = recv, None
        if debug:
            land = [torch.empty_like(t) for t in send]
            for t in recv:
                _poison(t)
            sent = [t.clone() for t in send]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in send] + \
              [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in land]
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
            self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                reqs = dist.batch_isend_irecv(ops)
            for t in send + land:
                t.record_stream(self.stream)
        else:
            reqs = dist.batch_isend_irecv(ops)
        _trace("start", _PHASE.get(tag, str(tag)), step)
        return _Pending(reqs, list(send), recv, land, sent, tag, step)

    def finish(self, p: _Pending) -> list:
        for r in p.reqs:
            r.wait()
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)
        if p.sent is not None:
            for i, (now, then) in enumerate(zip(p.send, p.sent)):
                if not torch.equal(_bits(now), _bits(then)):  # bitwise: NaN payloads compare too
                    raise RuntimeError(f"fp4gen.parallel (debug): send buffer {i} of {_PHASE.get(p.tag)} step "
                                       f"{p.step} changed while it was in flight")
            for r, t in zip(p.recv, p.land):
                r.copy_(t)
        _trace("finish", _PHASE.get(p.tag, str(p.tag)), p.step)
        return p.recv


# ---------------------------------------------------------------------------
# The LSE merge
# ---------------------------------------------------------------------------


def merge_partial(o_acc, lse_acc, o_b, lse_b):
    """Merge a block's normalised (o_b (B, S, H, D), lse_b (B, H, S)) into the running pair, in
    fp32: lse = logaddexp(lse_acc, lse_b), o = e^(lse_acc - lse) o_acc + e^(lse_b - lse) o_b.
    Rows with lse = -inf on both sides stay o = 0, lse = -inf (no NaN)."""
    lse = torch.logaddexp(lse_acc, lse_b)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_acc - ref).transpose(1, 2)[..., None]
    wb = torch.exp(lse_b - ref).transpose(1, 2)[..., None]
    return o_acc * wa + o_b.to(torch.float32) * wb, lse


# ---------------------------------------------------------------------------
# The ring as an autograd function
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Cfg:
    group: object
    key_full: str
    key_diag: Optional[str]
    softmax_scale: Optional[float]
    backend: str
    causal: bool
    balanced: bool
    wires_fwd: tuple  # (_Wire k, _Wire v)
    wires_bwd: tuple


def _ring_forward(q, k, v, cfg: _Cfg):
    world, rank = _world(cfg.group)
    ring = _Ring(cfg.group, q.device)
    wk, wv = cfg.wires_fwd
    kv = wk.encode(k) + wv.encode(v)
    nk = 1 if wk.fp8 is None else 2  # K's tensors come first
    B, S, H, D = q.shape
    o = torch.zeros(B, S, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(world):
        src = (rank - step) % world
        # the next block's transfer first, then this block's kernels, then the wait
        pending = ring.start(kv, tag=0, step=step) if step < world - 1 else None
        kb, vb = wk.decode(kv[:nk]), wv.decode(kv[nk:])
        _trace("compute", "fwd", step)
        for q0, q1, k0, k1, causal in _blocks(rank, src, world, S, cfg):
            key = cfg.key_diag if causal else cfg.key_full
            ob, lb, _ = torch.ops.fp4gen.attention_fwd(q[:, q0:q1], kb[:, k0:k1], vb[:, k0:k1], key,
                                                      cfg.softmax_scale, cfg.backend)
            o[:, q0:q1], lse[:, :, q0:q1] = _merge(o[:, q0:q1], lse[:, :, q0:q1], ob, lb)
        if pending is not None:
            kv = ring.finish(pending)
    _STATS["fwd_bytes_per_step"] = _nbytes(kv) if world > 1 else 0
    _STATS["fwd_transfers"] = world - 1
    return o.to(q.dtype), lse


def _blocks(rank, src, world, n_local, cfg):
    """``step_blocks`` (a module attribute, so that a planted-fault test can replace it)."""
    return step_blocks(rank, src, world, n_local, cfg.causal, cfg.balanced)


def _merge(o_acc, lse_acc, o_b, lse_b):
    """``merge_partial`` (replaceable by a planted-fault test, as ``_blocks``)."""
    return merge_partial(o_acc, lse_acc, o_b, lse_b)


def _ring_backward(q, k, v, o, lse, do, cfg: _Cfg):
    world, rank = _world(cfg.group)
    ring = _Ring(cfg.group, q.device)
    wk, wv = cfg.wires_bwd
    nk = 1 if wk.fp8 is None else 2
    kv = wk.encode(k) + wv.encode(v)
    S = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = [torch.zeros(k.shape, dtype=torch.float32, device=q.device),
           torch.zeros(v.shape, dtype=torch.float32, device=q.device)]
    incoming = None  # the dK/dV of the next block, on its way from the previous rank
    kv_bytes = _nbytes(kv)
    for step in range(world):
        src = (rank - step) % world
        pending = ring.start(kv, tag=1, step=step) if step < world - 1 else None
        kb, vb = wk.decode(kv[:nk]), wv.decode(kv[nk:])
        gk = torch.zeros_like(dkv[0])
        gv = torch.zeros_like(dkv[1])
        _trace("compute", "bwd", step)
        for q0, q1, k0, k1, causal in _blocks(rank, src, world, S, cfg):
            key = cfg.key_diag if causal else cfg.key_full
            gq, gk_b, gv_b = torch.ops.fp4gen.attention_bwd(
                q[:, q0:q1], kb[:, k0:k1], vb[:, k0:k1], o[:, q0:q1].contiguous(),
                lse[:, :, q0:q1].contiguous(), do[:, q0:q1].contiguous(), [], key, cfg.softmax_scale, cfg.backend)
            dq[:, q0:q1] += gq
            gk[:, k0:k1] += gk_b
            gv[:, k0:k1] += gv_b
        if incoming is not None:  # the dK/dV sent after the previous step's kernels, overlapped with these
            dkv = ring.finish(incoming)
        dkv[0] += gk
        dkv[1] += gv
        if world > 1:  # dK/dV go on with their block; after the last step they reach their owner
            incoming = ring.start(dkv, tag=2, step=step)
        if pending is not None:
            kv = ring.finish(pending)
    if incoming is not None:
        dkv = ring.finish(incoming)
    _STATS["bwd_bytes_per_step"] = (kv_bytes + _nbytes(dkv)) if world > 1 else 0
    _STATS["bwd_transfers"] = world
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        o, lse = _ring_forward(q, k, v, cfg)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, o, lse, do.contiguous(), ctx.cfg)
        return dq, dk, dv, None


# ---------------------------------------------------------------------------
# All-to-all (Ulysses)
# ---------------------------------------------------------------------------


def _seq_to_heads(x, group, balanced):
    """(B, S / W, H, D) sequence shards -> (B, S, H / W, D): this rank's head group, whole
    sequence in global order."""
    world, _ = _world(group)
    B, Sl, H, D = x.shape
    send = x.reshape(B, Sl, world, H // world, D).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[w]: rank w's tokens, my heads
    full = recv.permute(1, 0, 2, 3, 4).reshape(B, world * Sl, H // world, D)
    order = torch.cat([shard_indices(world * Sl, world, r, balanced=balanced) for r in range(world)])
    out = torch.empty_like(full)
    out.index_copy_(1, order.to(x.device), full)
    return out


def _heads_to_seq(x, group, balanced):
    """The inverse of ``_seq_to_heads``: (B, S, H / W, D) -> (B, S / W, H, D)."""
    world, _ = _world(group)
    B, S, Hl, D = x.shape
    order = torch.cat([shard_indices(S, world, r, balanced=balanced) for r in range(world)])
    sharded = x.index_select(1, order.to(x.device))  # rank w's tokens at w * Sl
    send = sharded.reshape(B, world, S // world, Hl, D).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[w]: my tokens, head group w
    return recv.permute(1, 2, 0, 3, 4).reshape(B, S // world, world * Hl, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, balanced):
        ctx.group, ctx.balanced = group, balanced
        return _seq_to_heads(x, group, balanced)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g.contiguous(), ctx.group, ctx.balanced), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, balanced):
        ctx.group, ctx.balanced = group, balanced
        return _heads_to_seq(x, group, balanced)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g.contiguous(), ctx.group, ctx.balanced), None, None


# ---------------------------------------------------------------------------
# The public function
# ---------------------------------------------------------------------------


def _check(q, k, v, mode, causal, balanced, world, group):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise AttentionInputError(f"{_WHO}: {name} must be this rank's (B, S / W, H, D) shard, got {got}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise AttentionInputError(f"{_WHO}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must "
                                  "have one shape, and q's B and D")
    H, Hkv = q.shape[2], k.shape[2]
    if Hkv == 0 or H % Hkv:
        raise AttentionInputError(f"{_WHO}: query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    if mode not in MODES:
        raise AttentionInputError(f"{_WHO}: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if causal and q.shape[1] != k.shape[1]:
        raise AttentionInputError(f"{_WHO}: a causal context-parallel call needs as many query as key tokens per "
                                  f"rank (self-attention), got {q.shape[1]} and {k.shape[1]}")
    if causal and balanced and q.shape[1] % 2:
        raise AttentionInputError(f"{_WHO}: balanced shards hold two chunks each; {q.shape[1]} local tokens is odd")
    if mode == "a2a" and (H % world or Hkv % world):
        raise AttentionInputError(f"{_WHO}: mode='a2a' splits the heads over the {world} ranks: H={H} and Hkv={Hkv} "
                                  "must both be multiples of it (use mode='ring')")
    if mode == "a2a" and q.shape[1] != k.shape[1]:
        raise AttentionInputError(f"{_WHO}: mode='a2a' needs as many query as key tokens per rank")
    # every rank must hold a shard of one shape (no ragged shards): min and max of the shapes agree
    dims = torch.tensor(list(q.shape) + list(k.shape), dtype=torch.int64,
                        device=q.device if dist.get_backend(group) == "nccl" else "cpu")
    lo, hi = dims.clone(), dims.clone()
    dist.all_reduce(lo, dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise AttentionInputError(f"{_WHO}: the ranks hold shards of different shapes (this rank q {tuple(q.shape)}, "
                                  f"k {tuple(k.shape)}); every rank needs an equal shard (shard_for_cp)")


def _spec_causal(spec_obj, causal):
    if spec_obj is None:
        raise AttentionInputError(f"{_WHO}: the spec of this generated module is unknown; pass a KernelSpec or .attn path")
    if spec_obj.sinks is not Sinks.NONE or spec_obj.layout is not Layout.DENSE or spec_obj.softcap < 0:
        raise AttentionInputError(f"{_WHO}: spec {spec_obj.name!r}: context parallelism takes dense specs without "
                                  "sinks (a sink joins each row's denominator once, not once per block)")
    if causal is None:
        if spec_obj.mask is Mask.WINDOW:
            raise AttentionInputError(f"{_WHO}: spec {spec_obj.name!r} has a window mask; context parallelism "
                                      "implements mask none and causal only")
        return spec_obj.mask is Mask.CAUSAL
    return bool(causal)


def _exchange_wires(spec_obj, exchange, k, v, dtype):
    """(K, V) wires of the forward and of the backward. ``exchange="auto"``: an FP8 operand of the
    spec travels as its FP8 payload in the forward; in the backward only where the backward
    reads that same payload (K: S recomputed from the reused K and dQ = dS K with FP8 dS; V:
    dP = dO V^T with FP8 dO), so that the gradients are the single-GPU backward's. "input":
    everything at the input's precision."""
    if exchange not in ("auto", "input"):
        raise AttentionInputError(f"{_WHO}: exchange must be 'auto' or 'input', got {exchange!r}")
    if exchange == "input":
        w = (_Wire(None, dtype), _Wire(None, dtype))
        return w, w
    fk, fv = _fp8_of(spec_obj.k), _fp8_of(spec_obj.v)
    bw = spec_obj.backward
    if bw is None:
        bk = bv = None
    else:
        bk = fk if ("k" in bw.reuse and bw.format_of("dS").format in _ref._FP8) else None
        bv = fv if bw.format_of("dO").format in _ref._FP8 else None
    return (_Wire(fk, dtype), _Wire(fv, dtype)), (_Wire(bk, dtype), _Wire(bv, dtype))


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, spec,
                               causal: Optional[bool] = None, softmax_scale: Optional[float] = None,
                               mode: str = "ring", backend: str = "auto", balanced: bool = True,
                               exchange: str = "auto", full_spec=None, return_lse: bool = False):
    """Attention with ``spec``'s numerics on sequence shards; differentiable in q, k, v.

    q: (B, S / W, H, D), k, v: (B, S / W, Hkv, D): this rank's shard of the group's sequence
    (``shard_for_cp`` with the same ``balanced``). Returns this rank's shard of O (q's dtype) and,
    with ``return_lse``, of the LSE (B, H, S / W) float32. ``causal``: None keeps the spec's mask
    (none or causal; windows are refused), the mask of the whole sequence. ``group``: a process
    group (None: the default group). ``mode``: "ring" or "a2a" (module docstring). ``exchange``:
    "auto" sends FP8 K/V for an FP8 recipe, "input" at the input's precision. ``full_spec``: the
    spec of the blocks that see every key (a causal ring's off-diagonal blocks); by default
    ``spec`` with mask none, which the reference runs; on a GPU it needs its own generated kernel,
    so pass the ``.attn`` block with ``mask none`` there. ``backend``: as ``fp4gen.attention``'s.
    """
    if backend not in torch_ops.BACKENDS:
        raise AttentionInputError(f"{_WHO}: backend must be one of {', '.join(torch_ops.BACKENDS)}, got {backend!r}")
    torch_ops.checks.check_causal(_WHO, causal)
    torch_ops.checks.check_softmax_scale(_WHO, softmax_scale)
    world, rank = _world(group)
    spec_obj = torch_ops.spec_for_key(torch_ops.spec_key(spec))
    causal = _spec_causal(spec_obj, causal)
    _check(q, k, v, mode, causal, balanced, world, group)
    _STATS.clear()
    _STATS.update(mode=mode, world=world, causal=causal, balanced=balanced)
    if mode == "a2a":
        qh, kh, vh = (_SeqToHeads.apply(x, group, balanced) for x in (q, k, v))
        o, lse = torch_ops.attention(qh, kh, vh, spec=spec, causal=causal, softmax_scale=softmax_scale,
                                     return_lse=True, backend=backend)
        o = _HeadsToSeq.apply(o, group, balanced)
        if not return_lse:
            return o
        lse = _heads_to_seq(lse.detach().transpose(1, 2)[..., None].contiguous(), group, balanced)[..., 0]
        return o, lse.transpose(1, 2).contiguous()
    generated = q.device.type == "cuda" and backend != "reference"
    wires_fwd, wires_bwd = _exchange_wires(spec_obj, exchange, k, v, k.dtype if generated else torch.float32)
    _STATS["exchange_fwd"] = {"k": wires_fwd[0].describe(k), "v": wires_fwd[1].describe(v)}
    _STATS["exchange_bwd"] = {"k": wires_bwd[0].describe(k), "v": wires_bwd[1].describe(v), "dk, dv": "float32"}
    cfg = _Cfg(group=group,
               key_full=torch_ops.spec_key(full_spec if full_spec is not None else spec, causal=False),
               key_diag=torch_ops.spec_key(spec, causal=True) if causal else None,
               softmax_scale=softmax_scale, backend=backend, causal=causal, balanced=balanced,
               wires_fwd=wires_fwd, wires_bwd=wires_bwd)
    o, lse = _RingAttention.apply(q, k, v, cfg)
    return (o, lse) if return_lse else o


def last_comm_stats() -> dict:
    """What the last call on this rank sent: mode, world, how K/V travelled (``exchange_fwd`` /
    ``exchange_bwd``), bytes one rank sends per ring step (``fwd_bytes_per_step``; the backward's
    ``bwd_bytes_per_step`` counts K/V and the fp32 dK/dV) and the number of transfers."""
    return dict(_STATS)
