"""Host side of the generated sm100a forward: operand preparation, argument checks, launch args.

No Blackwell GPU here, so this is what can be checked on the CPU:

- ``prepare_operands`` output read back *through the kernel's own global layouts*
  (``_gmem_layouts``, the function the kernel's ``__call__`` builds its tensors and TMA
  atoms from, traced by CuTe DSL with static sizes) dequantizes bit for bit to what
  ``fp4gen.numerics.reference.quantize_operand`` gives for the spec (ragged S, GQA), and
  every byte the layouts do not address is zero (padding);
- the prepared tensors have the shapes/dtypes of ``operand_layouts``, and the pointer
  types/alignments handed to the kernel at launch equal those of the fake compile;
- user errors get clear messages, the non-Blackwell refusal stays;
- (slow) the kernel compiles for sm_100a with the argument list built from prepared operands.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fp4gen.frontend import parse_file
from fp4gen.ir.passes import plan_kernel
from fp4gen.lowering import sm100
from fp4gen.numerics.formats import E2M1, E4M3, decode, decode_e8m0, unpack_fp4
from fp4gen.numerics.reference import quantize_operand

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VARIANTS = ("fa4_fp4_d128", "fa4_nvfp8_d128", "fa4_nvmx_accurate_d128", "sage3_fp4_d128")
# (B, Sq, Sk, H, Hkv): ragged Sq/Sk (not multiples of 128, 32 or 16), GQA, tiny
SHAPES = [(2, 200, 333, 4, 2), (1, 1, 1, 1, 1), (1, 129, 96, 3, 1), (2, 256, 257, 2, 2)]


def _plan(name):
    return plan_kernel(parse_file(EXAMPLES / f"{name}.attn")[0])


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """name -> (generated module, spec) for every supported sm100a example."""
    out = {}
    d = tmp_path_factory.mktemp("sm100_host")
    for name in VARIANTS:
        plan = _plan(name)
        path = d / f"{name}.py"
        path.write_text(sm100.render(plan))
        spec = importlib.util.spec_from_file_location(f"fp4gen_host_test_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out[name] = (mod, plan.spec, path)
    return out


def _inputs(B, Sq, Sk, H, Hkv, seed):
    """bf16 q, k, v whose rows span many binades, with an all-zero row and a large outlier."""
    g = torch.Generator().manual_seed(seed)

    def one(S, Hx):
        x = torch.randn(B, S, Hx, 128, generator=g)
        x = x * torch.exp2(torch.randint(-10, 10, (B, S, Hx, 1), generator=g).float())
        x[0, 0, 0] = 0.0  # an all-zero row: NVFP4 scale 0, MXFP4 scale code 0
        x[-1, -1, -1, 5] = 3.0e4  # an outlier that dominates its block
        return x.to(torch.bfloat16)

    return one(Sq, H), one(Sk, Hkv), one(Sk, Hkv)


# ------------------------------------------------------------- CuTe layouts -----

def _cute_layouts(mod, B, Sq, Sk, H, Hkv):
    """The kernel's global layouts for static sizes, as (shape, stride) Python tuples.

    ``_gmem_layouts`` is traced by CuTe DSL (a jit function with no kernel, compiled for the
    host); with static sizes its layouts are static and every ``cute.assume`` is checked.
    """
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as bsl

    got = {}

    @cute.jit
    def trace():
        for name, lay in mod._gmem_layouts(cute, bsl, Sq, Sk, B * H, B * Hkv).items():
            got[name] = None if lay is None else (lay.shape, lay.stride)

    cute.compile(trace)
    return got


def _flat(shape, stride):
    if isinstance(shape, tuple):
        out = []
        for s, d in zip(shape, stride):
            out += _flat(s, d)
        return out
    return [(shape, stride)]


def _offsets(layout, *coords):
    """Offsets (in elements) of the layout at logical coordinates (one tensor per top mode,
    broadcast together); each mode's coordinate is split colexicographically, as CuTe does."""
    shape, stride = layout
    if not isinstance(shape, tuple):
        shape, stride = (shape,), (stride,)
    assert len(shape) == len(coords)
    total = 0
    for ms, md, c in zip(shape, stride, coords):
        idx = c
        for s, d in _flat(ms, md):
            total = total + (idx % s) * d
            idx = idx // s
    return total


def _grid(*sizes):
    """Broadcastable index tensors for a dense grid of the given sizes."""
    n = len(sizes)
    return [torch.arange(s).reshape([s if i == j else 1 for j in range(n)]) for i, s in enumerate(sizes)]


def _addressed_rest_is_zero(buf: torch.Tensor, off: torch.Tensor, what: str):
    used = torch.zeros(buf.numel(), dtype=torch.bool)
    used[off.reshape(-1)] = True
    rest = buf.reshape(-1)[~used]
    assert int(rest.count_nonzero()) == 0, f"{what}: {int(rest.count_nonzero())} padding elements are not 0"
    assert int(off.max()) < buf.numel() and int(off.min()) >= 0, f"{what}: layout addresses outside the tensor"


def _bits(x):
    return x.contiguous().view(torch.int32)


def _read_fp4_operand(payload, sf, lay_x, lay_sf, sizes, sf_fmt):
    """Dequantize an FP4 operand through the kernel's layouts over a logical (a, b, l) grid.

    Returns (codes, scale codes, values), each of shape ``sizes``; checks padding is zero."""
    a, b, l = _grid(*sizes)
    nib = unpack_fp4(payload.reshape(-1))  # element e of the FP4 tensor is nibble e
    off = _offsets(lay_x, a, b, l)
    off_sf = _offsets(lay_sf, a, b, l)
    _addressed_rest_is_zero(nib, off, "payload")
    _addressed_rest_is_zero(sf.reshape(-1), off_sf, "scale factors")
    codes = nib[off]
    sc = sf.reshape(-1)[off_sf]
    scale = decode(sc, E4M3) if sf_fmt == "e4m3" else decode_e8m0(sc)
    return codes, sc, decode(codes, E2M1) * scale


# ------------------------------------------------------------------- tests -----

@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_prepared_operands_dequantize_to_the_reference(modules, name, shape):
    mod, spec, _ = modules[name]
    B, Sq, Sk, H, Hkv = shape
    q, k, v = _inputs(*shape, seed=VARIANTS.index(name) * 100 + SHAPES.index(shape))
    ops = mod.prepare_operands(q, k, v)
    t = ops.tensors
    lay = _cute_layouts(mod, *shape)
    L, Lkv, D = B * H, B * Hkv, 128

    # Q and K: NVFP4 along D, grid (S, D, batch*heads) as the kernel indexes them
    for name_x, x, fmt, S, Lx in (("q", q, spec.q, Sq, L), ("k", k, spec.k, Sk, Lkv)):
        codes, sc, vals = _read_fp4_operand(t[name_x], t["sf" + name_x], lay[name_x], lay["sf" + name_x],
                                            (S, D, Lx), "e4m3")
        ref = quantize_operand(x, fmt, 3, True).vals  # (B, S, Hx, D)
        ref = ref.permute(1, 3, 0, 2).reshape(S, D, Lx)
        assert torch.equal(_bits(vals), _bits(ref)), f"{name_x} dequantizes differently from the reference"

    # V, grid (D, Sk, batch*kv_heads) as the kernel indexes it
    ref_v = quantize_operand(v, spec.v, 1, True)
    want = ref_v.vals.permute(3, 1, 0, 2).reshape(D, Sk, Lkv)
    if mod.FWD_CONFIG.pv_fp8:
        d, s, l = _grid(D, Sk, Lkv)
        off = _offsets(lay["v"], d, s, l)
        _addressed_rest_is_zero(t["v"].reshape(-1), off, "V payload")
        vals = decode(t["v"].reshape(-1)[off], E4M3)
        assert torch.equal(_bits(vals), _bits(want))
        assert torch.equal(_bits(t["vs"]), _bits(ref_v.post_scale.reshape(Lkv)))
        assert lay["sfv"] is None
    else:
        assert mod.FWD_CONFIG.v_k_major  # FP4 B operands must be K-major
        _, _, vals = _read_fp4_operand(t["v"], t["sfv"], lay["v"], lay["sfv"], (D, Sk, Lkv), "e4m3" if mod.V_BLOCK == 16 else "e8m0")
        assert torch.equal(_bits(vals), _bits(want)), "V dequantizes differently from the reference"
        assert torch.equal(t["vs"], torch.ones(Lkv))


def test_layouts_are_not_trivially_equal(modules):
    """Guard against a vacuous comparison: a wrong SF atom order must be detected."""
    mod, spec, _ = modules["fa4_fp4_d128"]
    shape = (1, 256, 128, 1, 1)
    q, k, v = _inputs(*shape, seed=3)
    ops = mod.prepare_operands(q, k, v)
    lay = _cute_layouts(mod, *shape)
    sfq = ops.tensors["sfq"].reshape(-1, 512)
    swapped = sfq[[1, 0, 2, 3]].reshape(1, -1)  # the two K atoms of row tile 0 swapped
    _, _, good = _read_fp4_operand(ops.tensors["q"], ops.tensors["sfq"], lay["q"], lay["sfq"], (256, 128, 1), "e4m3")
    _, _, bad = _read_fp4_operand(ops.tensors["q"], swapped, lay["q"], lay["sfq"], (256, 128, 1), "e4m3")
    assert not torch.equal(good, bad)


@pytest.mark.parametrize("name", VARIANTS)
def test_gqa_head_mapping(modules, name):
    """The kernel reads K/V of (batch, head) bh at bh // group; that must be k[b, :, h // group]."""
    mod, spec, _ = modules[name]
    B, Sq, Sk, H, Hkv = 2, 64, 80, 6, 2
    q, k, v = _inputs(B, Sq, Sk, H, Hkv, seed=11)
    ops = mod.prepare_operands(q, k, v)
    group = H // Hkv
    kk = ops.tensors["k"]
    for b in range(B):
        for h in range(H):
            bh_kv = (b * H + h) // group  # the kernel's bh_kv
            solo = mod.prepare_operands(q[b:b + 1, :, :1], k[b:b + 1, :, h // group:h // group + 1],
                                        v[b:b + 1, :, h // group:h // group + 1])
            assert torch.equal(kk[bh_kv], solo.tensors["k"][0])
            assert torch.equal(ops.tensors["v"][bh_kv], solo.tensors["v"][0])


@pytest.mark.parametrize("name", VARIANTS)
def test_shapes_and_pointer_types_come_from_one_table(modules, name):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    mod, spec, _ = modules[name]
    B, Sq, Sk, H, Hkv = 2, 200, 333, 4, 2
    ops = mod.prepare_operands(*_inputs(B, Sq, Sk, H, Hkv, seed=5))
    lay = mod.operand_layouts(B, Sq, Sk, H, Hkv)
    assert list(ops.tensors) == list(lay)  # __call__'s argument order
    for n, s in lay.items():
        x = ops.tensors[n]
        assert tuple(x.shape) == s.shape and x.dtype == getattr(torch, s.torch_dtype) and x.is_contiguous(), n
    # the sizes a real buffer holds are the layouts' cosize (no over/under-allocation)
    cl = _cute_layouts(mod, B, Sq, Sk, H, Hkv)
    for n in ("q", "k", "v", "sfq", "sfk", "sfv", "o", "lse", "vs"):
        if cl[n] is None:
            continue
        coords = [torch.tensor(_size(m) - 1) for m in cl[n][0]] if isinstance(cl[n][0], tuple) else \
            [torch.tensor(cl[n][0] - 1)]
        last = int(_offsets(cl[n], *coords))
        per_elem = 2 if lay[n].cute_dtype == "Float4E2M1FN" else 1
        numel = ops.tensors[n].numel() * per_elem
        assert last < numel, f"{n}: the layout reaches element {last}, the tensor has {numel}"
    # launch pointers (from prepared tensors) == compile-time pointers (_fake_args)
    args = mod._kernel_args(ops, None, cuda.CUstream(0), fake=True)
    fake = mod._fake_args(cutlass, cute)
    assert len(args) == len(fake) == 15

    def sig(p):
        return (p.dtype, p.memspace, p._assumed_align)

    assert [sig(p) for p in args[:9]] == [sig(p) for p in fake[:9]]
    assert [getattr(cutlass, s.cute_dtype) for s in lay.values()] == [p.dtype for p in args[:9]]
    assert [int(a.value) for a in args[9:13]] == [Sq, Sk, B * H, H // Hkv]
    ref_c = torch.tensor(spec.scale * math.log2(math.e), dtype=torch.float32).item()
    assert torch.tensor(float(args[13].value), dtype=torch.float32).item() == ref_c  # the reference's c
    assert mod.SOFTMAX_SCALE == spec.scale


def _size(mode):
    return math.prod(s for s, _ in _flat(mode, mode))


def test_outputs_unpack_to_the_contract(modules):
    mod, _, _ = modules["fa4_fp4_d128"]
    B, Sq, Sk, H, Hkv = 2, 3, 5, 4, 2
    ops = mod._fake_operands(B, Sq, Sk, H, Hkv)
    ops.tensors["o"] = torch.arange(B * H * Sq * 128, dtype=torch.float32).reshape(B * H, Sq, 128).to(torch.bfloat16)
    ops.tensors["lse"] = torch.arange(B * H * Sq, dtype=torch.float32).reshape(B * H, Sq)
    o, lse = mod._outputs(ops, True)
    assert o.shape == (B, Sq, H, 128) and lse.shape == (B, H, Sq)
    for b, s, h in ((0, 0, 0), (1, 2, 3), (1, 0, 2)):
        assert torch.equal(o[b, s, h], ops.tensors["o"][b * H + h, s])
        assert lse[b, h, s] == ops.tensors["lse"][b * H + h, s]
    assert mod._outputs(ops, False).shape == (B, Sq, H, 128)


def test_bad_arguments_get_clear_messages(modules):
    mod, _, _ = modules["fa4_fp4_d128"]
    x = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="fa4_fp4_d128: q must be .*torch.bfloat16.*wrong dtype"):
        mod.prepare_operands(x.float(), x, x)
    with pytest.raises(ValueError, match="head dim 64 != 128"):
        mod.prepare_operands(x[..., :64], x[..., :64], x[..., :64])
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        mod.prepare_operands(torch.zeros(1, 8, 3, 128, dtype=torch.bfloat16), x, x)
    with pytest.raises(ValueError, match="non-empty"):
        mod.prepare_operands(torch.zeros(1, 0, 2, 128, dtype=torch.bfloat16), x, x)
    with pytest.raises(ValueError, match="batch \\* heads must be at most 65535"):
        big = torch.zeros(1, 1, 70000, 128, dtype=torch.bfloat16)
        mod.prepare_operands(big, big[:, :, :1], big[:, :, :1])


def test_forward_checks_arguments_on_a_blackwell_machine(modules, monkeypatch):
    """With an sm_100 GPU (faked), forward's first refusal is about the arguments."""
    mod, _, _ = modules["fa4_fp4_d128"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA B200")
    x = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor.*wrong device"):
        mod.forward(x, x, x)
    # forward's checks minus the device type (CPU tensors cannot pass it here)
    with pytest.raises(ValueError, match="softmax_scale must be a positive"):
        mod._check_args(x, x, x, -1.0, device_type=None)


def test_forward_refusals_keep_their_message(modules, monkeypatch):
    from fp4gen.runtime.checks import UnsupportedDeviceError

    mod, _, _ = modules["fa4_nvfp8_d128"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    x = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedDeviceError, match="sm_100a.*no CUDA GPU"):
        mod.forward(x, x, x)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (12, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA RTX 5090")
    with pytest.raises(UnsupportedDeviceError, match="RTX 5090 \\(sm_120\\)"):
        mod.forward(x, x, x)


_COMPILE_RUNNER = textwrap.dedent("""
    import importlib.util, sys
    import torch
    import cuda.bindings.driver as cuda
    spec = importlib.util.spec_from_file_location("fp4gen_host_compile", sys.argv[1])
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    B, Sq, Sk, H, Hkv = 2, 200, 333, 4, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Sq, H, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(B, Sk, Hkv, 128, generator=g).to(torch.bfloat16)
    ops = m.prepare_operands(q, k, k.clone())
    Kernel, cutlass, cute = m._build()
    cute.compile(Kernel(), *m._kernel_args(ops, 0.1, cuda.CUstream(0), fake=True))
    print("OK")
""")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fa4_fp4_d128", "fa4_nvfp8_d128"])
def test_kernel_compiles_with_the_prepared_operands(modules, name):
    """sm_100a compile with the argument list built from prepare_operands' tensors (ragged, GQA)."""
    _, _, path = modules[name]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a")
    r = subprocess.run([sys.executable, "-c", _COMPILE_RUNNER, str(path)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("name, v, match", [
    ("fa4_nvfp8_d128", ("FP8E4M3", "TOKEN", None), "FP8 V as fp8e4m3 with one scale per"),
    ("fa4_nvfp8_d128", ("FP8E4M3", "BLOCK", 128), "FP8 V as fp8e4m3 with one scale per"),
    ("fa4_fp4_d128", ("MXFP4", "BLOCK", 64), "MXFP4 V with blocks of 32"),
])
def test_lowering_refuses_v_formats_the_host_side_does_not_implement(name, v, match):
    """prepare_operands implements NVFP4/16 Q/K and MXFP4/32 or per-(batch, head) FP8 V only.
    (The front end already rejects most such specs; the lowering must not rely on it.)"""
    import dataclasses

    from fp4gen.ir.spec import Format, OperandFormat, ScaleGranularity
    from fp4gen.lowering import LoweringError

    plan = _plan(name)
    fmt = OperandFormat(getattr(Format, v[0]), getattr(ScaleGranularity, v[1]), v[2], plan.spec.v.scale)
    bad = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, v=fmt))
    with pytest.raises(LoweringError, match=match):
        sm100.render(bad)
    sm100.render(plan)  # the unmodified plan renders
