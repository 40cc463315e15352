"""Argument checks that generated kernels run before they launch.

A CuTe DSL kernel handed a wrong tensor does not fail politely: a bad stride
or an unaligned pointer becomes a TMA descriptor error, a hang or silently
wrong numbers. So every generated ``forward``/``backward`` validates its
arguments here first, and each failure names the kernel, says what was
expected and what was given, e.g.::

    fa4_fp8: q must be a CUDA tensor of dtype torch.bfloat16 with shape
    (B, S, H, 128); got torch.float32 (2, 77, 8, 64) on cpu

Conventions: ``TypeError`` when an argument has the wrong kind (not a tensor,
wrong dtype, a str for a bool), ``AttentionInputError`` (a ``ValueError``) when
its value is wrong (shape, device, layout, alignment, range),
``UnsupportedDeviceError`` (a ``RuntimeError``) when the machine cannot run the
kernel at all. The functions are pure (they only read their arguments and the
CUDA device properties) and return nothing useful except
``check_qkv``/``check_backward``, which return the problem sizes.

``fp4gen.attention`` runs the same checks as the generated modules (with
``kernel="fp4gen.attention"``), so both refuse the same arguments with the same
error and message.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from fp4gen.ir.spec import SOFTMAX_SCALE_RANGE, bound_text

# TMA (cp.async.bulk.tensor) needs a 16-byte aligned global base address and
# every non-unit global stride a multiple of 16 bytes.
TMA_ALIGN_BYTES = 16

QKV_DIMS = ("B", "S", "H", "D")


# What the reference backend computes with (and fp4gen.attention accepts): the float dtypes.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class AttentionInputError(ValueError):
    """A bad argument value to ``fp4gen.attention`` or a generated kernel (shape, device, layout, range)."""


class UnsupportedDeviceError(RuntimeError):
    """The machine cannot run this kernel (no GPU, or a GPU of another architecture)."""


# ---------------------------------------------------------------------------
# formatting helpers


def dtype_name(dtype) -> str:
    return str(dtype)  # 'torch.bfloat16'


def _dtypes_phrase(dtypes: Sequence) -> str:
    names = [dtype_name(d) for d in dtypes]
    if len(names) == 1:
        return f"dtype {names[0]}"
    return "dtype " + ", ".join(names[:-1]) + " or " + names[-1]


def _shape_phrase(dims: Sequence, head_dim: Optional[int]) -> str:
    dims = list(dims)
    if head_dim is not None and dims:
        dims[-1] = str(head_dim)
    return "(" + ", ".join(str(d) for d in dims) + ")"


def describe(t) -> str:
    """'torch.float32 (2, 77, 8, 64) on cpu' for a tensor, the type name otherwise."""
    if isinstance(t, torch.Tensor):
        return f"{dtype_name(t.dtype)} {tuple(t.shape)} on {t.device}"
    return f"an object of type {type(t).__name__}"


def _fail(kernel: str, name: str, expected: str, t, extra: str = "", exc=AttentionInputError):
    msg = f"{kernel}: {name} must be {expected}; got {describe(t)}"
    if extra:
        msg += f" ({extra})"
    raise exc(msg)


# ---------------------------------------------------------------------------
# single-tensor checks


def check_tensor(
    kernel: str,
    name: str,
    t,
    *,
    dtypes: Iterable,
    dims: Sequence = QKV_DIMS,
    head_dim: Optional[int] = None,
    device_type: Optional[str] = "cuda",
) -> None:
    """Tensor-ness, device type, dtype, rank and head dim of one tensor.

    ``dims`` names the expected dimensions (its length is the rank);
    ``head_dim``, when given, is the required size of the last one.
    ``device_type=None`` skips the device check (CPU reference backends).
    """
    dtypes = tuple(dtypes)
    where = "a CUDA tensor" if device_type == "cuda" else "a tensor"
    expected = f"{where} of {_dtypes_phrase(dtypes)} with shape {_shape_phrase(dims, head_dim)}"
    if not isinstance(t, torch.Tensor):
        _fail(kernel, name, expected, t, exc=TypeError)
    if t.device.type == "meta":
        _fail(kernel, name, expected, t, "a meta tensor has a shape but no data to compute with")
    if device_type is not None and t.device.type != device_type:
        _fail(kernel, name, expected, t, f"wrong device: expected {device_type}")
    if t.dtype not in dtypes:
        _fail(kernel, name, expected, t, "wrong dtype", exc=TypeError)
    if t.dim() != len(dims):
        _fail(kernel, name, expected, t, f"expected {len(dims)} dimensions, got {t.dim()}")
    if head_dim is not None and t.shape[-1] != head_dim:
        _fail(kernel, name, expected, t, f"head dim {t.shape[-1]} != {head_dim}")


def check_nonempty(kernel: str, name: str, t, dims: Sequence = QKV_DIMS) -> None:
    """No dimension of size 0: the kernels have no empty-input path (an empty softmax row has
    no defined output), so an empty batch, sequence or head count is refused, not zero-filled."""
    if t.numel() == 0:
        i = list(t.shape).index(0)
        raise AttentionInputError(
            f"{kernel}: {name} must be non-empty; got {describe(t)} (dimension {i}, {dims[i]}, is 0)"
        )


def tma_loadable(t, align: int = TMA_ALIGN_BYTES) -> bool:
    """Whether ``check_tma_layout`` accepts ``t`` (a quick yes/no for the per-call host path)."""
    st, n = t.stride(), t.shape
    if t.dim() and st[-1] != 1 and n[-1] != 1 or t.data_ptr() % align:
        return False
    size = t.element_size()
    return all(n[i] == 1 or (st[i] * size) % align == 0 for i in range(t.dim() - 1))


def check_tma_layout(kernel: str, name: str, t, *, align: int = TMA_ALIGN_BYTES) -> None:
    """What a TMA descriptor needs of a global tensor.

    The last dimension must be contiguous (stride 1), the base pointer
    ``align``-byte aligned and every other stride a multiple of ``align``
    bytes. Dimensions of size 1 are exempt from the stride rule: their stride
    is never used to form an address.
    """
    if tma_loadable(t, align):
        return
    itemsize = t.element_size()
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] != 1:
        raise AttentionInputError(
            f"{kernel}: {name} must have a contiguous last dimension (stride 1); got strides "
            f"{tuple(t.stride())} for {describe(t)}; call .contiguous() first"
        )
    ptr = t.data_ptr()
    if ptr % align:
        raise AttentionInputError(
            f"{kernel}: {name} must start at a {align}-byte aligned address (TMA); got address "
            f"0x{ptr:x} ({ptr % align} bytes past alignment) for {describe(t)}; a view with a "
            f"storage offset usually causes this: call .contiguous() or .clone() first"
        )
    for i, (size, stride) in enumerate(zip(t.shape[:-1], t.stride()[:-1])):
        if size != 1 and (stride * itemsize) % align:
            raise AttentionInputError(
                f"{kernel}: {name} stride of dimension {i} must be a multiple of {align} bytes (TMA); "
                f"got {stride} elements x {itemsize} bytes = {stride * itemsize} bytes for "
                f"{describe(t)} with strides {tuple(t.stride())}; call .contiguous() first"
            )


def check_same_device(kernel: str, **tensors) -> None:
    """All tensors on one device (one CUDA device, not just CUDA)."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    first_name, first = items[0]
    for n, t in items[1:]:
        if t.device != first.device:
            raise AttentionInputError(
                f"{kernel}: all tensors must be on the same device; {first_name} is on "
                f"{first.device} but {n} is on {t.device}"
            )


def check_softmax_scale(kernel: str, softmax_scale) -> None:
    """None, or a real number within the bounds of the spec's ``scale`` (``SOFTMAX_SCALE_RANGE``):
    outside them, scores overflow (or vanish) in fp32 and the output is all NaN (or uniform)."""
    if softmax_scale is None:
        return
    lo, hi = SOFTMAX_SCALE_RANGE
    expected = f"softmax_scale must be a positive finite number from {bound_text(lo)} to {bound_text(hi)}, or None"
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"{kernel}: {expected}; got {type(softmax_scale).__name__} {softmax_scale!r}")
    if not (math.isfinite(softmax_scale) and lo <= softmax_scale <= hi):
        raise AttentionInputError(f"{kernel}: {expected}; got {softmax_scale!r}")


def check_causal(kernel: str, causal) -> None:
    """None (the spec's mask), True or False; not a truthy str or int, which would silently mean True."""
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"{kernel}: causal must be True, False or None; got {type(causal).__name__} {causal!r}")


def check_name_arg(kernel: str, name: str, value) -> None:
    """An optional name (a kernel or target name): a str or None."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{kernel}: {name} must be a str or None; got {type(value).__name__} {value!r}")


# ---------------------------------------------------------------------------
# q, k, v together


@dataclass(frozen=True)
class AttentionSizes:
    """Problem sizes of one attention call, as read from q, k, v."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.heads_kv


def check_qkv(
    kernel: str,
    q,
    k,
    v,
    *,
    dtypes: Iterable = (torch.bfloat16,),
    head_dim: Optional[int] = None,
    device_type: Optional[str] = "cuda",
    tma: bool = True,
) -> AttentionSizes:
    """Validate ``q: (B, Sq, H, D)``, ``k, v: (B, Sk, Hkv, D)``; return the sizes.

    Checks, in order: tensor-ness, not meta, device type, dtype, rank and head
    dim of each; one dtype and one device for all; matching B and D; Sk and Hkv
    equal for k and v; no empty tensor (no zero head count either); H % Hkv == 0;
    and (``tma=True``) the layout TMA loads need.
    """
    dtypes = tuple(dtypes)
    named = (("q", q, ("B", "Sq", "H", "D")), ("k", k, ("B", "Sk", "Hkv", "D")), ("v", v, ("B", "Sk", "Hkv", "D")))
    for name, t, dims in named:
        check_tensor(kernel, name, t, dtypes=dtypes, dims=dims, head_dim=head_dim, device_type=device_type)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{kernel}: q, k and v must have one dtype; got {q.dtype}, {k.dtype} and {v.dtype}")
    check_same_device(kernel, q=q, k=k, v=v)
    B, Sq, H, D = q.shape
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != B:
            raise AttentionInputError(f"{kernel}: {name} must have the batch size of q ({B}); got {describe(t)}")
        if t.shape[3] != D:
            raise AttentionInputError(f"{kernel}: {name} must have the head dim of q ({D}); got {describe(t)}")
    if k.shape[1] != v.shape[1]:
        raise AttentionInputError(
            f"{kernel}: k and v must have the same sequence length; got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if k.shape[2] != v.shape[2]:
        raise AttentionInputError(
            f"{kernel}: k and v must have the same number of heads; got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    for name, t, dims in named:
        check_nonempty(kernel, name, t, dims)
    Sk, Hkv = k.shape[1], k.shape[2]
    if H % Hkv:
        raise AttentionInputError(
            f"{kernel}: the number of query heads must be a multiple of the number of key/value heads; "
            f"got H={H} (q {tuple(q.shape)}) and Hkv={Hkv} (k {tuple(k.shape)})"
        )
    if tma:
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tma_layout(kernel, name, t)
    return AttentionSizes(B, Sq, Sk, H, Hkv, D)


def check_backward(
    kernel: str,
    q,
    k,
    v,
    o,
    lse,
    do,
    *,
    dtypes: Iterable = (torch.bfloat16,),
    head_dim: Optional[int] = None,
    device_type: Optional[str] = "cuda",
    tma: bool = True,
) -> AttentionSizes:
    """The backward's arguments: q, k, v as for the forward; ``o`` and ``do``
    shaped like q (dtype of q); ``lse: (B, H, Sq)`` float32."""
    sizes = check_qkv(kernel, q, k, v, dtypes=dtypes, head_dim=head_dim, device_type=device_type, tma=tma)
    for name, t in (("o", o), ("do", do)):
        check_tensor(kernel, name, t, dtypes=(q.dtype,), dims=("B", "Sq", "H", "D"), head_dim=sizes.head_dim,
                     device_type=device_type)
        if tuple(t.shape) != tuple(q.shape):
            raise AttentionInputError(f"{kernel}: {name} must have the shape of q {tuple(q.shape)}; got {describe(t)}")
        if tma:
            check_tma_layout(kernel, name, t)
    check_tensor(kernel, "lse", lse, dtypes=(torch.float32,), dims=("B", "H", "Sq"), device_type=device_type)
    want = (sizes.batch, sizes.heads, sizes.seqlen_q)
    if tuple(lse.shape) != want:
        raise AttentionInputError(f"{kernel}: lse must have shape (B, H, Sq) = {want}; got {describe(lse)}")
    check_same_device(kernel, q=q, o=o, lse=lse, do=do)
    return sizes


def check_scale_tensor(kernel: str, name: str, t, *, shape: Sequence[int], dtypes: Iterable = (torch.float32,),
                       device_like=None) -> None:
    """A block/tensor scale argument: exact shape and dtype, on the device of ``device_like``."""
    dtypes = tuple(dtypes)
    expected = f"a tensor of {_dtypes_phrase(dtypes)} with shape {tuple(shape)}"
    if not isinstance(t, torch.Tensor):
        _fail(kernel, name, expected, t, exc=TypeError)
    if t.dtype not in dtypes:
        _fail(kernel, name, expected, t, "wrong dtype", exc=TypeError)
    if tuple(t.shape) != tuple(shape):
        _fail(kernel, name, expected, t, "wrong shape")
    if device_like is not None and t.device != device_like.device:
        _fail(kernel, name, expected, t, f"wrong device: expected {device_like.device}")


# ---------------------------------------------------------------------------
# the machine


def parse_arch(arch: str) -> tuple[int, int]:
    """'sm_90', 'sm_90a', 'sm90a', 'sm_100a' -> (major, minor) compute capability."""
    s = arch.strip().lower()
    if s.startswith("sm_"):
        s = s[3:]
    elif s.startswith("sm"):
        s = s[2:]
    s = s.rstrip("af")  # arch-specific ('a') and family ('f') suffixes
    if not s.isdigit() or len(s) < 2:
        raise ValueError(f"unknown GPU architecture {arch!r}; expected a name like 'sm_90a' or 'sm_100a'")
    return int(s[:-1]), int(s[-1])


def require_arch(arch: str, *, kernel: str = "fp4gen", device=None) -> None:
    """Refuse to run unless the current (or given) CUDA device is exactly ``arch``.

    An exact match is required: an ``sm_90a`` cubin uses wgmma/TMA
    instructions that no other compute capability executes.
    """
    want = parse_arch(arch)
    if not torch.cuda.is_available():
        raise UnsupportedDeviceError(
            f"{kernel}: this kernel needs an NVIDIA GPU of compute capability {want[0]}.{want[1]} ({arch}); "
            f"no CUDA device is available (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
            f"the 'reference' target runs anywhere"
        )
    got = tuple(torch.cuda.get_device_capability(device))
    if got != want:
        name = torch.cuda.get_device_name(device)
        raise UnsupportedDeviceError(
            f"{kernel}: this kernel was generated for {arch} (compute capability {want[0]}.{want[1]}); "
            f"the GPU is {name}, compute capability {got[0]}.{got[1]}; regenerate the spec for "
            f"target sm{got[0]}{got[1]}a if the compiler supports it, or use target 'reference'"
        )
