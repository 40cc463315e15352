"""to_svg(plan): the TMEM map (sm100a) and an event timeline of two KV tiles, as plain SVG text.

The TMEM map draws 512 columns x 128 lanes as one bar (2 px per column); regions
that reuse score columns (P, scale factors) are drawn inside their S region with
a leader line to their label. The timeline is the simulated schedule (see
``fp4gen.ir.passes.events.simulate``): one row per warp role, boxes coloured by
query stage, like FA4's ping-pong figure.
"""
from __future__ import annotations

from html import escape

from ..plan import KernelPlan

FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
STAGE_FILL = {0: "#4e79a7", 1: "#f28e2b", 2: "#59a14f", None: "#9c9c9c"}
KIND_FILL = {"S": "#cfe0f3", "O": "#d5ecd0", "P": "#7b3fa0", "SFP": "#e15759", "SFV": "#f1a33c",
             "SFQ": "#2f8f8f", "SFK": "#76b7b2"}
LEGEND = (("S", "S: fp32 scores (QK^T accumulator)"), ("O", "O: fp32 output accumulator"),
          ("P", "P: packed codes for PV"), ("SFP", "SFP: P block scales"), ("SFV", "SFV: V block scales"),
          ("SFQ", "SFQ: Q block scales"), ("SFK", "SFK: K block scales"))
SHORT = {"LOAD_K": "K", "LOAD_V": "V", "CP_SF_QK": "sf", "CP_SFV": "sf", "QK": "QK", "PV_1": "PV.1", "PV_2": "PV.2",
         "PV": "PV", "LOAD_S": "ld S", "ROWMAX": "max", "SOFTMAX": "P", "PUBLISH_P1": "p1", "PUBLISH_P2": "p2",
         "PUBLISH_P": "pub", "RESCALE_O": "resc", "EPILOGUE": "epi"}


def _wrap(text: str, width: int = 165) -> list[str]:
    """Greedy word wrap (SVG text does not wrap by itself)."""
    lines, cur = [], ""
    for w in text.split(" "):
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    return lines + ([cur] if cur else [])


def _kind(name: str) -> str:
    for k in ("SFP", "SFV", "SFQ", "SFK", "S", "O", "P"):
        if name.startswith(k):
            return k
    return "S"


def _text(x, y, s, size=12, anchor="start", fill="#222", weight="normal", extra=""):
    return (f"<text x='{x:.1f}' y='{y:.1f}' {FONT} font-size='{size}' text-anchor='{anchor}' fill='{fill}' "
            f"font-weight='{weight}' {extra}>{escape(str(s))}</text>")


def _tmem_map(plan: KernelPlan, y0: float) -> tuple[list[str], float]:
    tm = plan.tmem
    x0, px = 70.0, 2.0
    h = 128.0
    out = [_text(x0, y0 + 18, f"TMEM map: {tm.total_columns} of {tm.limit_columns} columns used "
                              f"(tcgen05.alloc {tm.alloc_columns}), 128 lanes x 32-bit cells; one query row per lane",
                 15, weight="bold")]
    top = y0 + 52
    # column axis
    for c in range(0, tm.limit_columns + 1, 32):
        x = x0 + c * px
        big = c % 128 == 0
        out.append(f"<line x1='{x}' y1='{top - (8 if big else 4)}' x2='{x}' y2='{top}' stroke='#444'/>")
        if c % 64 == 0:
            out.append(_text(x, top - 11, c, 11, "middle", weight="bold" if big else "normal"))
    out.append(_text(x0 - 8, top - 11, "column", 11, "end", "#555"))
    out.append(_text(x0 - 8, top + 10, "lane 0", 10, "end", "#555"))
    out.append(_text(x0 - 8, top + h, "lane 127", 10, "end", "#555"))
    # top-level regions
    wide = [r for r in tm.regions if r.alias_of is None and r.columns * px >= 80]
    for r in wide:
        x, w = x0 + r.first_col * px, r.columns * px
        out.append(f"<rect x='{x}' y='{top}' width='{w}' height='{h}' fill='{KIND_FILL[_kind(r.name)]}' "
                   f"stroke='#333' stroke-width='1.5'><title>{escape(r.name + ': ' + r.purpose)}</title></rect>")
        out.append(_text(x + w / 2, top + h - 30, r.name, 20, "middle", weight="bold"))
        out.append(_text(x + w / 2, top + h - 12, f"cols {r.first_col}-{r.last_col}, {r.dtype}", 10, "middle", "#333"))
    # regions inside S: full lane height strips, labels below with leader lines
    # narrow regions (inside S, or too narrow for a label of their own) get leader lines
    subs = sorted((r for r in tm.regions if r not in wide), key=lambda r: r.first_col)
    label_y = top + h + 22
    last_end = {0: -1e9, 1: -1e9, 2: -1e9}
    for r in subs:
        x, w = x0 + r.first_col * px, r.columns * px
        inset, hh = (4, h - 50) if r.alias_of is not None else (0, h)  # own columns: full height
        out.append(f"<rect x='{x}' y='{top + inset}' width='{w}' height='{hh}' fill='{KIND_FILL[_kind(r.name)]}' "
                   f"stroke='#222' stroke-width='0.6'><title>{escape(r.name + ': ' + r.purpose)}</title></rect>")
        label = f"{r.name} {r.first_col}-{r.last_col}"
        tw = 7.2 * len(label)
        cx = x + w / 2
        # stagger labels on three rows so narrow neighbours do not collide
        row = next((k for k in (0, 1, 2) if cx - tw / 2 > last_end[k] + 4), 2)
        last_end[row] = cx + tw / 2
        ly = label_y + row * 15
        y1 = top + h - 46 if r.alias_of is not None else top + h
        out.append(f"<line x1='{cx}' y1='{y1}' x2='{cx}' y2='{ly - 10}' stroke='#555' stroke-width='0.7'/>")
        out.append(_text(cx, ly, label, 10.5, "middle", KIND_FILL[_kind(r.name)] if _kind(r.name) != "SFV" else "#b06d00",
                         weight="bold"))
    y = label_y + 3 * 15 + 4
    # legend
    lx = x0
    for k, txt in LEGEND:
        if not any(_kind(r.name) == k for r in tm.regions):
            continue
        out.append(f"<rect x='{lx}' y='{y}' width='14' height='12' fill='{KIND_FILL[k]}' stroke='#333' stroke-width='0.6'/>")
        out.append(_text(lx + 19, y + 10.5, txt, 11))
        lx += 28 + 6.1 * len(txt)
        if lx > x0 + 900:
            lx, y = x0, y + 18
    y += 20
    # live intervals (stage 0; stage 1 is the same with the stage index swapped) and notes
    lines = _wrap("Live within one KV tile (stage 0; stage 1 alike): " + "; ".join(
        f"{r.name} {r.live.opens} .. {r.live.closes}" for r in tm.regions if r.stage == 0))
    for n in tm.notes:
        lines += _wrap("note: " + n)
    for i, line in enumerate(lines):
        out.append(_text(x0, y + 8 + 14 * i, line, 10.5, fill="#333"))
    return out, y + 8 + 14 * len(lines) + 10


def _timeline(plan: KernelPlan, y0: float, tiles: int = 2) -> tuple[list[str], float]:
    from ..passes.events import roles_in_order, simulate
    sim = simulate(plan, tiles)
    roles = roles_in_order(plan.events)
    x0, width = 110.0, 1010.0
    scale = width / max(sim.makespan, 1.0)
    row_h, gap = 26.0, 6.0
    out = [_text(20, y0 + 18, f"Event timeline: {tiles} KV tiles, simulated with the cost model's cycles "
                              f"({sim.makespan:.0f} cycles); colour = query stage", 15, weight="bold")]
    top = y0 + 34
    for i, r in enumerate(roles):
        y = top + i * (row_h + gap)
        out.append(f"<rect x='{x0}' y='{y}' width='{width}' height='{row_h}' fill='#f4f4f4'/>")
        out.append(_text(x0 - 8, y + row_h / 2 + 4, r, 12, "end"))
    for sp in sim.spans:
        i = roles.index(sp.event.role)
        y = top + i * (row_h + gap)
        x, w = x0 + sp.start * scale, max((sp.end - sp.start) * scale, 1.5)
        fill = STAGE_FILL.get(sp.event.stage, "#9c9c9c")
        light = sp.tile % 2 == 1
        out.append(f"<rect x='{x:.1f}' y='{y + 2}' width='{w:.1f}' height='{row_h - 4}' fill='{fill}' "
                   f"fill-opacity='{0.55 if light else 1.0}' stroke='#fff' stroke-width='0.8'>"
                   f"<title>{escape(sp.label)}: cycles {sp.start:.0f}-{sp.end:.0f}</title></rect>")
        if sp.event.name.startswith("PV"):
            out.append(f"<rect x='{x:.1f}' y='{y + 2}' width='{w:.1f}' height='{row_h - 4}' fill='url(#stripes)'/>")
        if sp.event.name == "SOFTMAX":  # the stage is the colour; the path name is what matters
            lab = f"{'Direct-P' if plan.spec.p_production.kind.value == 'direct_p' else 'exp'} j{sp.tile}"
        else:
            lab = f"{SHORT.get(sp.event.name, sp.event.name)}{'' if sp.event.stage is None else sp.event.stage} j{sp.tile}"
        if w > 6.2 * len(lab) + 4:
            out.append(_text(x + w / 2, y + row_h / 2 + 4, lab, 10, "middle", "#fff", "bold"))
        elif w > 6.2 * len(lab.split()[0]) + 2:
            out.append(_text(x + w / 2, y + row_h / 2 + 4, lab.split()[0], 9, "middle", "#fff", "bold"))
    ybot = top + len(roles) * (row_h + gap)
    step = 500 if sim.makespan > 3000 else 250
    c = 0
    while c <= sim.makespan:
        x = x0 + c * scale
        out.append(f"<line x1='{x:.1f}' y1='{ybot - 4}' x2='{x:.1f}' y2='{ybot + 2}' stroke='#444'/>")
        out.append(_text(x, ybot + 14, c, 10, "middle"))
        c += step
    out.append(_text(x0 + width, ybot + 28, "cycles", 10, "end", "#555"))
    ly = ybot + 30
    lx = x0
    for st, txt in ((0, "stage 0"), (1, "stage 1"), (None, "shared (K/V loads)")):
        if st is not None and not any(e.stage == st for e in plan.events):
            continue
        out.append(f"<rect x='{lx}' y='{ly}' width='14' height='12' fill='{STAGE_FILL[st]}'/>")
        out.append(_text(lx + 19, ly + 10.5, txt, 11))
        lx += 40 + 6.5 * len(txt)
    out.append(_text(lx, ly + 10.5, "striped: PV;  lighter: odd KV tiles", 11))
    y = ly + 30
    legend = ("Labels: K/V = TMA loads, QK = S = Q K^T, PV(.1/.2) = O += P V (on each half of P), sf = tcgen05.cp of "
              "scale factors, ld = load S (tcgen05.ld), max = row max, exp / Direct-P = P codes, p1/p2/pub = "
              "publish P, resc = rescale O, epi = epilogue. Hover a box for its name and cycles.")
    for line in _wrap(legend, 175):
        out.append(_text(x0, y, line, 10, fill="#555"))
        y += 13
    y += 2
    if plan.publish is not None:
        what = "TMEM ownership: QK^T of tile j+1 may write S only after " if plan.tmem is not None else \
            "Register ownership: the next QK^T may overwrite S/P registers only after "
        out.append(_text(x0, y, what + plan.publish.s_free_after, 10.5, fill="#333"))
        y += 14
    return out, y + 10


def to_svg(plan: KernelPlan) -> str:
    """The TMEM map (sm100a) and the event timeline as one standalone SVG document."""
    parts: list[str] = []
    s = plan.spec
    y = 10.0
    fmts = ", ".join(f"{k} {s.operand(k).format.value}" for k in ("Q", "K", "P", "V"))
    parts.append(_text(20, y + 16, f"{s.name}  ({s.target.value})", 17, weight="bold"))
    parts.append(_text(20, y + 34, f"head_dim {s.head_dim}, tile {s.schedule.tile_m} x {s.schedule.tile_n}, {fmts}, "
                                   f"P via {s.p_production.kind.value}, O {s.o.format.value}", 12, fill="#333"))
    y += 46
    if plan.tmem is not None:
        body, y = _tmem_map(plan, y)
        parts += body
    if plan.events:
        body, y = _timeline(plan, y + 10)
        parts += body
    if plan.tmem is None and not plan.events:
        parts.append(_text(20, y + 20, f"target {s.target.value}: no TMEM and no event schedule to draw", 13))
        y += 30
    w, h = 1160, int(y + 10)
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' viewBox='0 0 {w} {h}'>\n"
            f"<defs><pattern id='stripes' width='6' height='6' patternUnits='userSpaceOnUse' "
            f"patternTransform='rotate(45)'><rect width='2.5' height='6' fill='white' fill-opacity='0.55'/>"
            f"</pattern></defs>\n"
            f"<rect width='{w}' height='{h}' fill='white'/>\n" + "\n".join(parts) + "\n</svg>\n")
