"""to_text(plan): the human-readable schedule that ``fp4gen schedule`` prints."""
from __future__ import annotations

from ..plan import KernelPlan
from ..spec import Layout, Mask, Sinks
from .jsonform import SIM_TILES, event_id


def _tile(dj: int) -> str:
    return "j" if dj == 0 else f"j{dj:+d}"


def _tmem_bar(plan: KernelPlan, width: int = 64) -> list[str]:
    """One character per 512/width columns; top-level regions only, aliases listed below."""
    tm = plan.tmem
    per = tm.limit_columns // width
    row = ["."] * width
    for r in tm.regions:
        if r.alias_of is None:
            for c in range(r.first_col // per, min(width, r.last_col // per + 1)):
                row[c] = "="
            label = r.name
            a = r.first_col // per
            for i, ch in enumerate(label):
                if a + 1 + i <= r.last_col // per:
                    row[a + 1 + i] = ch
            row[a] = "|"
    ticks = "".join(f"{c:<{width // 4}}" for c in range(0, tm.limit_columns, tm.limit_columns // 4))
    return ["    " + "".join(row) + "|", "    " + ticks + str(tm.limit_columns)]


def mask_text(s) -> str:
    """The mask as the spec writes it, then softcap, sinks and layout where the spec sets them:
    "mask window(128, 0), softcap 30, sinks learned, layout varlen" (and a kv_cache block's
    summary). A spec that sets none of
    the three prints "mask causal" (or "mask none") alone, as dumps always did."""
    if s.mask is Mask.WINDOW and s.window is not None:
        parts = [f"mask window({s.window[0]}, {s.window[1]})"]
    else:
        parts = [f"mask {s.mask.value}"]
    if s.softcap:
        parts.append(f"softcap {s.softcap:g}")
    if s.sinks is not Sinks.NONE:
        parts.append(f"sinks {s.sinks.value}")
    if s.layout is not Layout.DENSE:
        parts.append(f"layout {s.layout.value}")
    if s.kv_cache is not None:
        parts.append(str(s.kv_cache))
    return ", ".join(parts)


def _decode_lines(d) -> list[str]:
    """The decode section: the cache, the row packing, the split-KV rule, its choice for a few
    shapes, the combine."""
    store = f"paged(page_size={d.page_size})" if d.page_size else d.storage
    L = ["", f"Decode (kv_cache): {store}, {d.cache_format}, q_tokens {d.q_tokens}, gqa {d.gqa}; "
             f"{d.cache_bytes_per_token:g} bytes of K+V per token and KV head",
         f"  rows: {d.rows_per_cta} query rows per KV head in {d.row_tiles} tile(s) of {d.row_tile}; "
         f"keys in tiles of {d.tile_n}",
         f"  split-KV on {d.device}: {d.split_rule}",
         f"    (min_tiles_per_split {d.min_tiles_per_split}, max_splits {d.max_splits}, "
         f"split_efficiency {d.split_efficiency:g})",
         f"  {'batch':>7} {'kv_heads':>8} {'cache':>7} {'ctas':>6} {'tiles':>6} {'splits':>6} "
         f"{'cache MB':>9} {'HBM-bound us':>12}"]
    for e in d.examples:
        L.append(f"  {e.batch:7d} {e.kv_heads:8d} {e.cache_len:7d} {e.ctas:6d} {e.key_tiles:6d} {e.splits:6d} "
                 f"{e.cache_bytes / 1e6:9.1f} {e.hbm_us:12.1f}")
    L.append(f"  (HBM-bound: one read of the cache at {d.hbm_bytes_per_s / 1e12:g} TB/s)")
    L.append(f"  combine: {d.combine}")
    for n in d.notes:
        L.append(f"  note: {n}")
    return L


def _transform_lines(t) -> list[str]:
    """The outlier transforms: one line per separate pass with its HBM bytes, then the total at
    the example shape (a prediction)."""
    L = ["", f"Transforms (torch passes around the kernel, not fused): {', '.join(t.transforms)}",
         f"  {'transform':16} {'pass':34} {'per row of':>10} {'read B':>7} {'written B':>9}"]
    for p in t.passes:
        L.append(f"  {p.transform:16} {p.step:34} {p.per:>10} {p.bytes_read:7d} {p.bytes_written:9d}")
    b, h, s = t.example
    L.append(f"  B={b}, H={h}, S={s}, bf16: {t.example_bytes / 1e6:.1f} MB, predicted {t.example_us:g} us at "
             f"{t.hbm_bytes_per_s / 1e12:g} TB/s (bytes only, not measured)")
    return L


def to_text(plan: KernelPlan) -> str:
    s = plan.spec
    sch = s.schedule
    L: list[str] = []
    L.append(f"kernel {s.name}  target {s.target.value}  ({s.source_file})")
    L.append(f"  head_dim {s.head_dim}, {mask_text(s)}, tile {sch.tile_m} x {sch.tile_n}, "
             f"q_stages {plan.pipeline.q_stages if plan.pipeline else sch.q_stages}, "
             f"kv_stages {plan.pipeline.kv_stages if plan.pipeline else sch.kv_stages or '-'}, "
             f"P via {s.p_production.kind.value}"
             + (f"({s.p_production.policy.value}, a={s.p_production.a}, b={s.p_production.b})"
                if s.p_production.kind.value == "direct_p" and not s.p.format.is_fp8 else ""))
    L.append("")
    L.append("MMA")
    for m in plan.mma:
        L.append(f"  {m.name}  {m.a} x {m.b}")
        L.append(f"      {m.kind}; A {m.a_source} {m.a_major}, B {m.b_source} {m.b_major}"
                 + (f"; {m.sf_dtype} scales per {m.sf_block}" if m.block_scaled else "")
                 + (f"; {m.flops_per_clk_sm} FLOP/clk/SM" if m.flops_per_clk_sm else ""))
    L.append("")
    L.append("Operand contracts")
    for c in plan.contracts:
        blk = f"block {c.block}, " if c.block else ""
        sc = f"scale {c.scale_dtype} ({c.granularity})" if c.scale_dtype else f"scale {c.granularity}"
        L.append(f"  {c.operand}  {c.payload} ({c.bits} bit), {blk}{sc}; {c.major}; in {c.storage}")
        L.append(f"      scales: {c.scale_layout}")
        L.append(f"      quantized by: {c.quantized_by}")
        for n in c.notes:
            L.append(f"      note: {n}")
    if plan.tmem is not None:
        tm = plan.tmem
        L.append("")
        L.append(f"TMEM: {tm.total_columns} of {tm.limit_columns} columns, tcgen05.alloc {tm.alloc_columns}, "
                 f"lanes 0..127 (one query row per lane)")
        L += _tmem_bar(plan)
        L.append(f"  {'columns':>11}  {'region':8} {'dtype':34} live (per KV tile)")
        top = [r for r in tm.regions if r.alias_of is None]
        for r in sorted(top, key=lambda r: r.first_col):
            L.append(f"  [{r.first_col:3d}, {r.last_col:3d}]  {r.name:8} {r.dtype:34} {r.live.opens} .. {r.live.closes}"
                     + (" (whole loop)" if r.live.loop == "whole_loop" else ""))
            for a in sorted((x for x in tm.regions if x.alias_of == r.name), key=lambda x: x.first_col):
                L.append(f"    [{a.first_col:3d}, {a.last_col:3d}]  {a.name:6} {a.dtype:34} {a.live.opens} .. {a.live.closes}")
                L.append(f"    {'':10}  {'':6} inside {r.name}: {a.purpose}")
        for n in tm.notes:
            L.append(f"  note: {n}")
    if plan.publish is not None:
        pb = plan.publish
        L.append("")
        L.append(f"P publish: {pb.mode}")
        for p in pb.parts:
            cols = f", P columns +{p.p_columns[0]}..+{p.p_columns[1]}" if p.p_columns else ""
            sc = " + all block scales" if p.with_scales else ""
            L.append(f"  part {p.index}: keys {p.keys[0]}..{p.keys[1]}{cols}{sc} -> arrive {p.barrier}[s]; "
                     f"unblocks {p.unblocks}")
        L.append(f"  S of the stage is free for the next QK^T after: {pb.s_free_after}")
        for n in pb.notes:
            L.append(f"  note: {n}")
    if plan.pipeline is not None:
        pp = plan.pipeline
        L.append("")
        L.append("Warp roles (registers per thread after setmaxnreg)")
        for r in pp.roles:
            L.append(f"  {r.name:11} {r.warps} warp(s) x {r.registers:3d} regs  {r.does}")
        L.append(f"  registers: {pp.registers_total} of {pp.registers_limit} per SM")
        if pp.spill_budget_bytes:
            L.append(f"  spills allowed: {pp.spill_budget_bytes} bytes ({pp.spill_reason})")
        L.append(f"Shared memory: {pp.smem_bytes} of {pp.smem_limit} bytes")
        for i in pp.smem:
            L.append(f"  {i.name:9} {i.bytes:7d}  {i.detail}")
        L.append(f"MMA issue order: {pp.mma_order}")
        for n in pp.notes:
            L.append(f"  note: {n}")
    if plan.sm90 is not None:
        s9 = plan.sm90
        L.append(f"Sm90Plan: tile {s9.tile_m} x {s9.tile_n}, {s9.consumer_warpgroups} consumer warpgroup(s), "
                 f"kv_stages {s9.kv_stages}, v_transposed {s9.v_transposed}, "
                 f"intra_warpgroup_overlap {s9.intra_warpgroup_overlap}, pingpong {s9.pingpong}, "
                 f"producer {s9.producer_registers} / consumer {s9.consumer_registers} regs"
                 + (", l = P @ ones on the tensor cores" if s9.l_from_mma else ""))
    if plan.backward is not None:
        b = plan.backward
        L.append("")
        roles = getattr(b, "roles", None)  # sm100a: warp roles and a TMEM map instead of MMA warpgroups
        who = (", ".join(f"{r.name} x{r.warps}" for r in roles) + " warps" if roles
               else f"{b.mma_warpgroups} MMA warpgroups")
        L.append(f"Backward ({'causal' if b.causal else 'no mask'}): {b.tile_n} keys per CTA, {b.tile_m}-row query "
                 f"steps, {who}, {b.mma_format} MMAs, dQ by {b.dq_reduction}, "
                 f"smem {b.smem_bytes} of {b.smem_limit} bytes, reuse {' '.join(b.reuse) or 'none'}")
        tmem = getattr(b, "tmem", None)
        if tmem is not None:
            L.append(f"  TMEM: {tmem.alloc_columns} columns allocated; "
                     + ", ".join(f"{r.name} {r.first_col}..{r.last_col}"
                                 + (f" (over {r.alias_of})" if r.alias_of else "") for r in tmem.regions))
        for m in b.mmas:
            L.append(f"  {m.name:3} {m.formula:28} {m.operand_format:8} A {m.a_source} ({m.a_major}-major), "
                     f"B {m.b_major}-major; {m.warpgroup_split}")
    if plan.events:
        L.append("")
        L.append("Events of KV tile j (each role runs its lines top to bottom; j-1 = previous tile)")
        stages = sorted({e.stage for e in plan.events if e.stage is not None})
        for key in [None] + stages:
            evs = [e for e in plan.events if e.stage == key]
            L.append("  shared:" if key is None else f"  stage {key}:")
            for e in evs:
                waits = ", ".join(f"{w.barrier}({_tile(e.dj + w.dj)})" for w in e.waits) or "-"
                sig = ", ".join(e.signals) or "-"
                acc = []
                if e.reads:
                    acc.append("reads " + " ".join(a.region + ("" if not a.part else f".h{a.part}") for a in e.reads))
                if e.writes:
                    acc.append("writes " + " ".join(a.region + ("" if not a.part else f".h{a.part}") for a in e.writes))
                last = " [last tile]" if e.last_tile_only else ""
                L.append(f"    {e.role:10} {event_id(e) + '(' + _tile(e.dj) + ')':18} wait {waits}; signal {sig}"
                         + (f"; {'; '.join(acc)}" if acc else "") + last)
    if plan.cost is not None:
        c = plan.cost
        L.append("")
        rows = (plan.pipeline.q_stages * sch.tile_m) if s.target.value == "sm100a" else sch.tile_m
        L.append(f"Cost model: cycles per KV tile per SM ({rows} query rows x {sch.tile_n} keys)")
        units = [u.unit for u in c.paths[0].units]
        L.append("  " + f"{'path':19}" + "".join(f"{u:>8}" for u in units) + "   bottleneck")
        for p in c.paths:
            mark = "*" if p.path == c.chosen else " "
            L.append(f" {mark}{p.path:19}" + "".join(f"{u.cycles:8.0f}" for u in p.units)
                     + f"   {p.bottleneck} ({p.cycles_per_tile:.0f})")
        L.append("  (* = the path this spec asks for; assumptions in docs/plan.md and the JSON dump)")
        from ..passes.events import simulate
        sim = simulate(plan, SIM_TILES)
        L.append(f"Simulated: {SIM_TILES} KV tiles in {sim.makespan:.0f} cycles (no deadlock, no TMEM hazard)")
    if plan.decode is not None:
        L += _decode_lines(plan.decode)
    if plan.transforms is not None:
        L += _transform_lines(plan.transforms)
    if plan.notes:
        L.append("")
        for n in plan.notes:
            L.append(f"note: {n}")
    return "\n".join(L) + "\n"
