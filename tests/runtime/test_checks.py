"""fp4gen.runtime.checks: every failure names the kernel, what was expected and what was given."""

import pytest
import torch

from fp4gen.runtime import checks
from fp4gen.runtime.checks import UnsupportedDeviceError

BF16 = (torch.bfloat16,)


def qkv(B=2, S=77, H=8, D=64, Sk=None, Hkv=None, dtype=torch.bfloat16):
    Sk = S if Sk is None else Sk
    Hkv = H if Hkv is None else Hkv
    return (torch.zeros(B, S, H, D, dtype=dtype), torch.zeros(B, Sk, Hkv, D, dtype=dtype),
            torch.zeros(B, Sk, Hkv, D, dtype=dtype))


def cpu_check(*a, **kw):
    # device checks are exercised separately; here the layout rules on CPU tensors
    return checks.check_qkv("k1", *a, device_type=None, **kw)


def test_brief_example_message():
    q = torch.zeros(2, 77, 8, 64)
    with pytest.raises(ValueError) as e:
        checks.check_tensor("fa4_fp8", "q", q, dtypes=BF16, dims=("B", "S", "H", "D"), head_dim=128)
    assert str(e.value).startswith(
        "fa4_fp8: q must be a CUDA tensor of dtype torch.bfloat16 with shape (B, S, H, 128); "
        "got torch.float32 (2, 77, 8, 64) on cpu")


def test_not_a_tensor_is_type_error():
    with pytest.raises(TypeError, match=r"k1: q must be a tensor .*got an object of type list"):
        checks.check_tensor("k1", "q", [1, 2], dtypes=BF16, device_type=None)


def test_wrong_dtype_is_type_error_and_lists_choices():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.float16)
    with pytest.raises(TypeError) as e:
        checks.check_tensor("k1", "q", q, dtypes=(torch.bfloat16, torch.float8_e4m3fn), device_type=None)
    msg = str(e.value)
    assert "dtype torch.bfloat16 or torch.float8_e4m3fn" in msg and "got torch.float16" in msg


def test_ndim_and_head_dim():
    with pytest.raises(ValueError, match="expected 4 dimensions, got 3"):
        checks.check_tensor("k1", "q", torch.zeros(4, 2, 64, dtype=torch.bfloat16), dtypes=BF16, device_type=None)
    with pytest.raises(ValueError, match=r"shape \(B, S, H, 128\).*head dim 64 != 128"):
        checks.check_tensor("k1", "q", torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16), dtypes=BF16,
                            head_dim=128, device_type=None)


def test_good_qkv_returns_sizes():
    s = cpu_check(*qkv(B=2, S=77, H=8, D=64, Sk=130, Hkv=2), dtypes=BF16, head_dim=64)
    assert (s.batch, s.seqlen_q, s.seqlen_k, s.heads, s.heads_kv, s.head_dim, s.group) == (2, 77, 130, 8, 2, 64, 4)


def test_mismatched_batch_and_head_dim():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k must have the batch size of q \(2\)"):
        cpu_check(q, k[:1], v)
    with pytest.raises(ValueError, match="v must have the head dim of q"):
        cpu_check(q, k, torch.zeros(2, 77, 8, 32, dtype=torch.bfloat16))


def test_k_v_seqlen_and_heads_must_match():
    q, k, _ = qkv(S=64)
    with pytest.raises(ValueError, match="k and v must have the same sequence length"):
        cpu_check(q, k, torch.zeros(2, 63, 8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="k and v must have the same number of heads"):
        cpu_check(q, k, torch.zeros(2, 64, 4, 64, dtype=torch.bfloat16))


def test_gqa_divisibility():
    with pytest.raises(ValueError, match=r"multiple of the number of key/value heads; got H=8 .* Hkv=3"):
        cpu_check(*qkv(H=8, Hkv=3))


def test_empty_refused():
    with pytest.raises(checks.AttentionInputError,
                       match=r"^k1: q must be non-empty; got torch.bfloat16 \(2, 0, 8, 64\) on cpu "
                             r"\(dimension 1, Sq, is 0\)$"):
        cpu_check(*qkv(S=0, Sk=5))


def test_last_dim_must_be_contiguous():
    q, k, v = qkv(S=64, D=64)
    qt = q.transpose(1, 3)  # D no longer innermost, shape (2, 64, 8, 64)
    with pytest.raises(ValueError, match=r"q must have a contiguous last dimension \(stride 1\)"):
        cpu_check(qt, k, v)


def test_misaligned_base_pointer():
    q, k, v = qkv(S=64, D=64)
    buf = torch.zeros(q.numel() + 1, dtype=torch.bfloat16)
    q_off = buf[1:].view(q.shape)  # 2 bytes past a 16-byte boundary
    if q_off.data_ptr() % 16 == 0:  # pragma: no cover - allocator gave an odd base
        pytest.skip("allocator alignment makes the offset view aligned")
    with pytest.raises(ValueError, match="16-byte aligned address"):
        cpu_check(q_off, k, v)


def test_stride_not_multiple_of_16_bytes():
    # D=64 slice of a D=68 buffer: the row stride is 68 * 2 = 136 bytes, not a multiple of 16
    base = torch.zeros(2, 64, 8, 68, dtype=torch.bfloat16)
    q = base[..., :64]
    _, k, v = qkv(S=64, D=64)
    with pytest.raises(ValueError, match=r"q stride of dimension 2 must be a multiple of 16 bytes.*136 bytes"):
        cpu_check(q, k, v)
    # the same view passes when the TMA rules are not asked for
    cpu_check(q, k, v, tma=False)


def test_aligned_padded_stride_is_accepted():
    # a D=64 view of a D=72 buffer: stride 144 bytes is a multiple of 16, so TMA can read it
    q = torch.zeros(2, 64, 8, 72, dtype=torch.bfloat16)[..., :64]
    _, k, v = qkv(S=64, D=64)
    cpu_check(q, k, v)


def test_size_one_dims_are_exempt_from_stride_rule():
    t = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16).as_strided((1, 64, 1, 64), (3, 64, 5, 1))
    checks.check_tma_layout("k1", "q", t)


def test_device_type_required():
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor .*on cpu \(wrong device: expected cuda\)"):
        checks.check_qkv("k1", *qkv(), dtypes=BF16)


def test_same_device_required():
    a = torch.zeros(1, 2, 1, 16, dtype=torch.bfloat16)
    b = torch.zeros(1, 2, 1, 16, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="q is on cpu but k is on meta"):
        checks.check_same_device("k1", q=a, k=b, v=None)


def test_backward_args():
    q, k, v = qkv(S=16)
    o, do = torch.zeros_like(q), torch.zeros_like(q)
    lse = torch.zeros(2, 8, 16)
    s = checks.check_backward("k1", q, k, v, o, lse, do, device_type=None)
    assert s.seqlen_q == 16
    with pytest.raises(ValueError, match=r"lse must have shape \(B, H, Sq\) = \(2, 8, 16\)"):
        checks.check_backward("k1", q, k, v, o, torch.zeros(2, 16, 8), do, device_type=None)
    with pytest.raises(TypeError, match="lse must be a tensor of dtype torch.float32"):
        checks.check_backward("k1", q, k, v, o, lse.double(), do, device_type=None)
    with pytest.raises(ValueError, match="do must have the shape of q"):
        checks.check_backward("k1", q, k, v, o, lse, do[:, :8], device_type=None)


def test_softmax_scale():
    checks.check_softmax_scale("k1", None)
    checks.check_softmax_scale("k1", 0.125)
    for bad, exc in ((0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), ("0.1", TypeError),
                     (True, TypeError)):
        with pytest.raises(exc, match="softmax_scale must be a positive"):
            checks.check_softmax_scale("k1", bad)


def test_scale_tensor():
    t = torch.zeros(2, 8, dtype=torch.float32)
    checks.check_scale_tensor("k1", "q_scale", t, shape=(2, 8))
    with pytest.raises(ValueError, match=r"q_scale must be a tensor of dtype torch.float32 with shape \(2, 4\)"):
        checks.check_scale_tensor("k1", "q_scale", t, shape=(2, 4))


@pytest.mark.parametrize("name,cc", [("sm_90", (9, 0)), ("sm_90a", (9, 0)), ("sm90a", (9, 0)),
                                     ("sm_100a", (10, 0)), ("SM_120f", (12, 0))])
def test_parse_arch(name, cc):
    assert checks.parse_arch(name) == cc


def test_parse_arch_rejects_garbage():
    with pytest.raises(ValueError, match="unknown GPU architecture 'hopper'"):
        checks.parse_arch("hopper")


def test_require_arch_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UnsupportedDeviceError, match=r"k1: this kernel needs an NVIDIA GPU of compute "
                                                     r"capability 9\.0 \(sm_90a\); no CUDA device"):
        checks.require_arch("sm_90a", kernel="k1")


def test_require_arch_wrong_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    with pytest.raises(UnsupportedDeviceError) as e:
        checks.require_arch("sm_90a", kernel="k1")
    msg = str(e.value)
    assert "generated for sm_90a (compute capability 9.0)" in msg and "NVIDIA B200, compute capability 10.0" in msg
    assert isinstance(e.value, RuntimeError)


def test_require_arch_right_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    checks.require_arch("sm_90a")  # no exception


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_pass_and_cross_device_refused():
    q, k, v = (t.cuda() for t in qkv(S=64))
    s = checks.check_qkv("k1", q, k, v, dtypes=BF16, head_dim=64)
    assert s.seqlen_k == 64
    with pytest.raises(ValueError, match="all tensors must be on the same device|wrong device"):
        checks.check_qkv("k1", q, k.cpu(), v, dtypes=BF16)
