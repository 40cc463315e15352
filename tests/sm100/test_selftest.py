"""``fp4gen selftest`` and its unit kernels (fp4gen/device/sm100/selftest_kernels.py).

CPU: each unit kernel compiles for sm_100a and its PTX holds the form it tests (decoded with
``fp4gen.lowering.descriptors``); the expected values agree with an independent float64
computation, and each wrong hypothesis (swapped nibbles, sf_id 0 on the second step, a clobbered
first product, the all-zero O of a broken TMEM-A MMA) is told apart from the right one; the
command lists its checks and exits 0 without an sm_100 GPU, and exits 1 when a (fake) check
fails. GPU (``-m gpu``, skipped unless the GPU is an sm_100): the unit kernels against their
expected values.
"""
import json
import re

import pytest
import torch

from fp4gen.device.sm100 import selftest_kernels as sk

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # OCP MX v1.0 E2M1 magnitudes, codes 0-7
MMA_FORM = "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block32"
KERNELS = ("pv_mxfp4_tmem_a", "e2m1_nibble_order_tmem", "accumulator_column_reuse")


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    """Each distinct kernel's PTX, compiled once per session (on-disk cache keyed by the source's
    sha256 under FP4GEN_SELFTEST_CACHE, default /tmp/selftest)."""
    return {name: sk.compile_only(name) for name in KERNELS}


# ------------------------------------------------------------------ compiled form


def _mmas(text):
    from fp4gen.lowering import descriptors

    return descriptors.mma_instructions(text)


@pytest.mark.slow
@pytest.mark.parametrize("name", KERNELS)
def test_unit_kernel_compiles_to_the_block32_tmem_a_form(ptx, name):
    text = ptx[name]
    cfg = sk.kernel_config(name)
    mmas = _mmas(text)
    assert len(mmas) == cfg.k_steps * cfg.products
    for i, m in enumerate(mmas):
        line = text.splitlines()[m.line - 1].strip()
        assert line.startswith(MMA_FORM), line
        # A is a TMEM address operand "[%r..]" (an SMEM-A MMA has a 64-bit descriptor register)
        assert re.match(re.escape(MMA_FORM) + r"\S*\s+\[%r\d+\],\s*\[%r\d+\],\s*%rd\d+", line), line
        assert m.a_source == "tmem"
        f = m.idesc
        assert (f["M"], f["N"], f["K"]) == (sk.M, sk.N, 64)
        assert (f["a_type"], f["b_type"], f["scale"]) == ("e2m1", "e2m1", "ue8m0")
        assert (f["a_major"], f["b_major"]) == (0, 0)
        step, product = i % cfg.k_steps, i // cfg.k_steps
        # block32: K step s reads scale bytes of keys 64s.. through sf_id 2s in the same columns
        # (PTX ISA 9.7.16.10.7), as the forward's PV
        assert (f["a_sf_id"], f["b_sf_id"]) == (2 * step, 2 * step)
        a, sfa, sfb, d = (("A", "SFA", "SFB", "D"), ("A2", "SFA2", "SFB2", "D2"))[product]
        assert m.d.column == sk.COL[d]
        assert m.a.column == sk.COL[a] + 8 * step  # 8 columns = 64 E2M1 codes per lane
        assert (m.sf_a.column, m.sf_b.column) == (sk.COL[sfa], sk.COL[sfb])
        assert m.enable_input_d is (step != 0)
    # A arrives as the forward's P: two tcgen05.st.32x32b.x8 per product; scales by tcgen05.cp
    assert len(re.findall(r"tcgen05\.st\.sync\.aligned\.32x32b\.x8\.b32", text)) == 2 * cfg.products
    assert len(re.findall(r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4", text)) == 2 * cfg.products
    assert "tcgen05.commit" in text and "tcgen05.ld.sync.aligned.32x32b.x32" in text


@pytest.mark.slow
def test_reuse_kernel_writes_over_the_first_products_operands(ptx):
    m = _mmas(ptx["accumulator_column_reuse"])
    first, second = m[:2], m[2:]
    d2 = range(second[0].d.column, second[0].d.column + sk.N)  # fp32: one column per D column
    # the second product's D covers every TMEM column the first read: A (16 columns) and scales
    for x in first:
        assert x.a.column in d2 and x.a.column + 7 in d2
        assert x.sf_a.column in d2 and x.sf_b.column in d2
    # and the two are issued back to back, by one thread, with nothing waited on in between
    lines = ptx["accumulator_column_reuse"].splitlines()[first[-1].line:second[0].line - 1]
    assert not any("mbarrier" in ln or "tcgen05.wait" in ln for ln in lines)


@pytest.fixture(scope="module")
def fenced_ptx():
    return {name: sk.compile_only(name, fenced=True) for name in ("pv_mxfp4_tmem_a", "accumulator_column_reuse")}


@pytest.mark.slow
def test_fenced_variants_add_the_isa_fences_and_nothing_else(ptx, fenced_ptx):
    """The follow-up kernels: the same MMAs, plus tcgen05.fence::before_thread_sync before the
    two arrives that publish tcgen05 work and ::after_thread_sync after the waits before tcgen05
    work (PTX ISA 9.7.16.6.4.3/.4); the unfenced kernels have none (as the forward)."""
    for name, text in fenced_ptx.items():
        plain = [(m.kind, m.d.column, m.a.column, m.idesc["a_sf_id"]) for m in _mmas(ptx[name])]
        assert [(m.kind, m.d.column, m.a.column, m.idesc["a_sf_id"]) for m in _mmas(text)] == plain
        reuse = name == "accumulator_column_reuse"
        assert text.count("tcgen05.fence::before_thread_sync") == 2
        assert text.count("tcgen05.fence::after_thread_sync") == 3 + reuse
        assert "tcgen05.fence" not in ptx[name]
    # reuse: commit + wait between the products (ISA 9.7.16.6.4.2), absent without fences
    text = fenced_ptx["accumulator_column_reuse"]
    m = _mmas(text)
    between = text.splitlines()[m[1].line:m[2].line - 1]
    assert any("tcgen05.commit" in ln for ln in between) and any("mbarrier.try_wait" in ln for ln in between)
    assert any("tcgen05.fence::after_thread_sync" in ln for ln in between)


@pytest.mark.slow
def test_unit_kernels_assemble_for_sm100a(ptx, fenced_ptx):
    """The standalone ptxas (the register gate's) accepts every kernel for sm_100a, no spills."""
    from fp4gen.lowering import ptxas

    for text in list(ptx.values()) + list(fenced_ptx.values()):
        try:
            (r,) = ptxas.assemble(text)
        except ptxas.PtxasUnavailable as e:
            pytest.skip(str(e))
        assert r.spill_store_bytes == r.spill_load_bytes == 0, r


@pytest.mark.slow
def test_ptx_checks_catch_the_wrong_kernel(ptx):
    """Planted fault for the form test: the one-step kernel's PTX lacks the sf_id 2 step."""
    m = _mmas(ptx["e2m1_nibble_order_tmem"])
    assert [x.idesc["a_sf_id"] for x in m] == [0]
    assert [x.idesc["a_sf_id"] for x in _mmas(ptx["pv_mxfp4_tmem_a"])] == [0, 2]


def test_compile_cache_key_follows_the_source():
    cfg = sk.kernel_config("pv_mxfp4_tmem_a")
    assert sk._source_key(cfg) != sk._source_key(sk.kernel_config("accumulator_column_reuse"))
    assert sk._source_key(cfg) != sk._source_key(sk.kernel_config("pv_mxfp4_tmem_a", fenced=True))
    assert sk.kernel_config("block32_sf_id") == cfg  # same code, other operands (documented)


# ------------------------------------------------------------------ expected values


def _deq64(codes, sf):
    """float64 dequantisation from the E2M1 value table and 2^(e - 127), no fp4gen codec."""
    c = codes.long()
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float64)[c & 7]
    val = torch.where((c & 8) != 0, -mag, mag)
    scale = torch.pow(2.0, sf.double() - 127).repeat_interleave(32, dim=-1)
    return val * scale


@pytest.mark.parametrize("name", sk.CHECKS)
def test_expected_matches_float64(name):
    ops = sk.operands(name)
    exp = sk.expected(ops)
    k = ops.k_used
    ref = torch.stack([_deq64(a, ops.sfa)[:, :k] @ _deq64(ops.b_codes, ops.sfb)[:, :k].T for a in ops.a_codes])
    assert torch.equal(exp, ref)
    # the operands keep fp32 accumulation exact, so the tolerance only absorbs the tensor core
    assert torch.equal(exp.float().double(), exp)
    assert float(exp.abs().max()) > 0


def test_pack_a_words_is_the_forwards_p_packing():
    # key 8w + c in nibble c of word w (direct_p.sat_block)
    codes = sk._codes(torch.Generator().manual_seed(3), (2, sk.K))
    w = sk.pack_a_words(codes)
    for r in range(2):
        for j in range(sk.K // 8):
            word = int(w[r, j]) & 0xFFFFFFFF
            assert [(word >> (4 * c)) & 0xF for c in range(8)] == [int(x) for x in codes[r, 8 * j:8 * j + 8]]
    swapped = sk.pack_a_words(codes, "high_first")
    assert not torch.equal(swapped, w)


def test_device_tensors_layouts():
    from fp4gen.numerics import formats, quant

    ops = sk.operands("block32_sf_id")
    t = sk.device_tensors(ops, "cpu")
    assert t["a"].shape == (1, sk.M, sk.K // 8) and t["a"].dtype == torch.int32
    assert torch.equal(formats.unpack_fp4(t["b"]), ops.b_codes)
    assert torch.equal(quant.from_tcgen05_sf_layout(t["sfb"], sk.N, sk.K // 32), ops.sfb)
    assert t["sfb"].numel() == 512  # one 128 x 4 scale-factor atom
    assert torch.isnan(t["d"]).all()  # an MMA that writes nothing cannot pass


# ------------------------------------------------------------------ planted faults


def test_nibble_check_names_the_order():
    ops = sk.operands("e2m1_nibble_order_tmem")
    low, high = sk.expected(ops), sk.expected(ops, nibble_order="high_first")
    assert not torch.equal(low, high)  # the operands tell the two orders apart
    # row i: one nonzero at the odd key k_i (low nibble first) or k_i - 1 (high first)
    i = torch.arange(sk.M)
    k = 2 * (i % 32) + 1
    assert torch.equal(low[0].abs().argmax(1), k) and torch.equal(high[0].abs().argmax(1), k - 1)
    ok, _, words = sk.judge("e2m1_nibble_order_tmem", low.float())
    assert ok and words.startswith("low nibble")
    ok, err, words = sk.judge("e2m1_nibble_order_tmem", high.float())
    assert not ok and err >= 1 and words.startswith("HIGH nibble")
    # neither order (here: every code read two keys later): the observed map is reported
    ok, _, words = sk.judge("e2m1_nibble_order_tmem", torch.roll(low, 2, dims=2).float())
    assert not ok and "1->3, 3->5" in words


def test_sf_id_check_catches_step_two_reading_block_zero_scales():
    ops = sk.operands("block32_sf_id")
    wrong = sk.expected(ops, sf_id_step2=0)
    ok, err, words = sk.judge("block32_sf_id", wrong.float())
    assert not ok and err > 0.5 and "not honoured" in words
    assert sk.judge("block32_sf_id", sk.expected(ops).float())[0]


@pytest.mark.parametrize("fault", ["zeros", "nan", "one_element", "transposed"])
def test_pv_check_catches(fault):
    got = sk.expected(sk.operands("pv_mxfp4_tmem_a")).float()
    if fault == "zeros":  # the public FP4 attempt's all-zero O from this MMA form
        got = torch.zeros_like(got)
    elif fault == "nan":
        got[0, 5, 7] = float("nan")
    elif fault == "one_element":
        got[0, 100, 3] += 4.0
    else:
        got = got.transpose(1, 2).contiguous()
    ok, err, words = sk.judge("pv_mxfp4_tmem_a", got)
    assert not ok and err > sk.RTOL
    if fault == "zeros":
        assert "all zero" in words


def test_reuse_check_catches_a_clobbered_first_product():
    exp = sk.expected(sk.operands("accumulator_column_reuse")).float()
    got = exp.clone()
    got[0, :, :8] = 1.0e7  # as if the first MMA read fp32 garbage from its overwritten A columns
    ok, _, words = sk.judge("accumulator_column_reuse", got)
    assert not ok and "first product rel. error" in words and sk.judge("accumulator_column_reuse", exp)[0]


def test_run_refuses_without_sm100(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="sm_100"):
        sk.run("pv_mxfp4_tmem_a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    with pytest.raises(RuntimeError, match="H200 is sm_90"):
        sk.run("pv_mxfp4_tmem_a")


# ------------------------------------------------------------------ the command


@pytest.fixture
def cli(capsys):
    """``fp4gen ARGS`` in-process -> (rc, stdout, stderr)."""
    from types import SimpleNamespace

    from fp4gen.cli.main import main

    def run(*argv):
        capsys.readouterr()
        rc = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return SimpleNamespace(rc=rc, out=out, err=err)

    return run


@pytest.fixture
def no_sm100(monkeypatch):
    from fp4gen import selftest

    monkeypatch.setattr(selftest, "sm100_device", lambda: (False, "no CUDA GPU is visible"))


def _expected_names():
    from fp4gen import selftest

    return list(sk.CHECKS) + [spec.name for _, spec in selftest.sm100_examples()]


def test_plan_lists_units_then_every_sm100a_example():
    from fp4gen import selftest

    items = selftest.plan()
    names = [i.name for i in items]
    assert names == _expected_names()
    assert {"fa4_fp4_d128", "fa4_nvfp8_d128", "fa4_nvmx_accurate_d128", "sage3_fp4_d128"} <= set(names)
    assert [i.kind for i in items[:4]] == ["unit"] * 4 and {i.kind for i in items[4:]} == {"example"}


def test_selftest_without_sm100_lists_and_exits_0(cli, no_sm100):
    r = cli("selftest")
    assert r.rc == 0, r
    for n in _expected_names():
        assert n in r.out
    assert "nothing run" in r.out


def test_selftest_json_parses(cli, no_sm100):
    r = cli("selftest", "--json")
    assert r.rc == 0, r
    doc = json.loads(r.out)
    assert doc["ran"] is False
    assert [c["name"] for c in doc["checks"]] == _expected_names()
    assert {c["status"] for c in doc["checks"]} == {"not run"}


def test_selftest_on_this_machine_exits_0(cli):
    """The real device probe: this CPU machine (or a non-sm_100 GPU) runs nothing."""
    from fp4gen import selftest

    if selftest.sm100_device()[0]:
        pytest.skip("an sm_100 GPU is present: the full run is test_unit_kernels_on_blackwell's")
    r = cli("selftest")
    assert r.rc == 0 and "nothing run" in r.out, r


@pytest.mark.parametrize("status,rc", [("pass", 0), ("fail", 1), ("error", 1)])
def test_selftest_exit_status_follows_the_rows(cli, monkeypatch, status, rc):
    """Planted failure: on a (faked) sm_100 machine one failing or erroring check exits 1."""
    from fp4gen import selftest

    monkeypatch.setattr(selftest, "sm100_device", lambda: (True, "fake B200"))
    seen = []

    def fake(item, timeout=selftest.CHECK_TIMEOUT_S):
        seen.append(selftest.row_name(item))
        st = status if item.name == "block32_sf_id" else "pass"
        return selftest.Row(selftest.row_name(item), item.kind, item.what, st, 0.0, 0.1, "fake")

    monkeypatch.setattr(selftest, "run_isolated", fake)
    r = cli("selftest")
    assert r.rc == rc, r
    names = _expected_names()
    if status != "pass":  # a failing unit check is run again with the ISA's fences, right after
        names.insert(names.index("block32_sf_id") + 1, "block32_sf_id+fences")
    assert seen == names
    assert re.search(r"block32_sf_id\s+unit\s+" + status, r.out), r.out
    r = cli("selftest", "--json")
    assert r.rc == rc and json.loads(r.out)["ran"] is True


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, "scaled", "nan", "lse"])
def test_example_check_compares_with_the_reference_backend(monkeypatch, fault):
    """The example row's plumbing on the CPU: the 'kernel' is the reference module itself (a
    pass with error 0), or that module with a planted fault."""
    import fp4gen.api
    from fp4gen import selftest

    item = next(i for i in selftest.plan() if i.name == "fa4_fp4_d128")
    # a smaller problem than the kit's (the CPU reference is slow); still ragged and GQA
    monkeypatch.setattr(selftest, "EXAMPLE_SHAPE",
                        {"batch": 1, "seqlen_q": 130, "seqlen_k": 140, "heads": 2, "heads_kv": 1})
    real_load = fp4gen.api.load
    ref = real_load(item.spec, kernel=item.name, target="reference")

    class Faulty:
        HEAD_DIM = 128

        @staticmethod
        def forward(q, k, v, return_lse=False):
            o, lse = ref.forward(q, k, v, return_lse=True)
            if fault == "scaled":
                o = o * 1.1
            elif fault == "nan":
                o = o.clone()
                o[0, 3, 1, 5] = float("nan")
            elif fault == "lse":
                lse = lse + 0.1
            return o, lse

    monkeypatch.setattr(fp4gen.api, "load", lambda spec, kernel=None, target=None:
                        real_load(spec, kernel=kernel, target=target) if target else Faulty)
    row = selftest.run_example(item, device="cpu")
    if fault is None:
        assert row.status == "pass" and row.max_error == 0.0, row
    else:
        assert row.status == "fail", row


@pytest.mark.slow
def test_isolated_check_reports_an_error_row():
    """The subprocess path on this machine: the kernel refuses (no sm_100), the row says so."""
    from fp4gen import selftest

    if selftest.sm100_device()[0]:
        pytest.skip("an sm_100 GPU is present")
    item = selftest.plan()[0]
    row = selftest.run_isolated(item)
    assert row.status == "error" and "sm_100" in row.detail, row
    row = selftest.run_isolated(item, timeout=0.01)
    assert row.status == "error" and "no result within" in row.detail


# ------------------------------------------------------------------ on Blackwell


@pytest.mark.gpu
@pytest.mark.parametrize("fenced", [False, True], ids=["forward_sync", "fenced"])
@pytest.mark.parametrize("name", sk.CHECKS)
def test_unit_kernels_on_blackwell(name, fenced):
    if torch.cuda.get_device_capability() != (10, 0):
        pytest.skip("needs an sm_100 GPU (B200/GB200)")
    got, exp = sk.run(name, fenced=fenced)
    ok, err, words = sk.judge(name, got)
    assert ok, f"{name}{' (fenced)' if fenced else ''}: rel. error {err:.3g}: {words}"
