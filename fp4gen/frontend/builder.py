"""Parse tree -> ``KernelSpec`` values, checking every word the grammar let through.

Each kernel is checked on its own and every problem is collected, so one run
reports all the bad values of a file. Checks here are about the language
(a format name exists, nvfp4 means 1x16 blocks with e4m3 scales, P is the only
operand with `via`); what a target can run is the planner's business.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional, Sequence

from lark import Token, Tree

from fp4gen.ir.plan import TMEM_COLUMNS
from fp4gen.ir.spec import (
    BACKWARD_OPERANDS, DIRECT_P_A_RANGE, DIRECT_P_B_RANGE, DIRECT_P_FORMATS, FORWARD_OPERANDS, FP8_TOKEN_BLOCKS,
    GUARD_L_RANGE, GUARD_M_RANGE, HADAMARD_SEED_RANGE, HEAD_DIM_RANGE, KV_CACHE_FORMATS, KV_GQA_RANGE, KV_PAGE_SIZES, KV_Q_TOKENS_RANGE,
    KV_STAGES_RANGE, MX_BLOCK, Q_STAGES_RANGE, REUSABLE_STATE, SOFTCAP_RANGE, SOFTMAX_SCALE_RANGE, TILE_RANGE,
    SINK_TOKENS_RANGE, WINDOW_RANGE,
    Backward, CacheFormat, DirectPPolicy, Format, Guard, GuardKind, KernelSpec, KvCache, KvStorage, Layout, Mask,
    OperandFormat, PKind, PProduction,
    PPublish, PSource, ScaleGranularity, Schedule, Sinks, SourceLoc, Target, TmemRegionRequest, Transforms,
    bound_text,
    default_operand_format, mask_for_window,
)

from .diagnostics import Diagnostic, Note, did_you_mean, one_of

ELEMENT_FORMATS = tuple(f.value for f in Format if f not in (Format.E8M0, Format.E4M3))
TARGETS = tuple(t.value for t in Target)
MASKS = tuple(m.value for m in Mask)
SINKS = tuple(x.value for x in Sinks)
LAYOUTS = tuple(x.value for x in Layout)
P_KINDS = tuple(k.value for k in PKind)
POLICIES = tuple(p.value for p in DirectPPolicy)
PUBLISH = tuple(p.value for p in PPublish)
P_SOURCES = tuple(p.value for p in PSource)
GUARDS = tuple(g.value for g in GuardKind)
# words accepted by `scale=` inside a format's parentheses
SCALE_WORDS = ("tensor", "token", "none", "fp32", "e8m0", "e4m3")

KERNEL_KEYWORDS = ("target", "head_dim", "mask", "softcap", "sinks", "layout", "scale", "guard", "rotate",
                   "sink_tokens", "schedule", "backward", "kv_cache")
# outlier transforms written after an operand's format: word -> (operand, Transforms field)
OPERAND_OPTIONS = {"smooth": ("K", "smooth_k"), "channel_scale": ("V", "channel_scale_v")}
ROTATIONS = ("hadamard",)
SCHEDULE_KEYWORDS = ("tile", "q_stages", "kv_stages", "p_publish", "p_source", "tmem")
BACKWARD_KEYWORDS = ("reuse", "deterministic")
KV_CACHE_KEYWORDS = ("storage", "format", "q_tokens", "gqa")
BLOCK_HOME = {**{k: "schedule" for k in SCHEDULE_KEYWORDS}, **{k: "backward" for k in BACKWARD_KEYWORDS},
              **{k: "kv_cache" for k in KV_CACHE_KEYWORDS}}
KV_STORAGES = tuple(x.value for x in KvStorage)
KV_FORMATS = tuple(f.value for f in KV_CACHE_FORMATS)

EXAMPLE_FORMAT = {"bf16": "bf16", "fp8": "fp8e4m3(scale=tensor)"}

# A number literal longer than this is refused before it is converted: no field needs more
# digits, and int() of thousands of digits is slow (and over 4300 digits a ValueError).
MAX_NUMBER_CHARS = 40


class _Errors:
    def __init__(self, filename: str):
        self.filename = filename
        self.diags: list[Diagnostic] = []

    def loc(self, item) -> SourceLoc:
        if isinstance(item, Token):
            return SourceLoc(self.filename, item.line, item.column)
        return SourceLoc(self.filename, item.meta.line, item.meta.column)

    def error(self, item, message: str, hint: Optional[str] = None, notes=(), span: Optional[int] = None):
        if span is None:
            span = len(str(item)) if isinstance(item, Token) else 1
        self.diags.append(Diagnostic(self.loc(item), message, tuple(notes), hint, span))


@dataclass
class _Arg:
    name: str
    key: Token  # the argument's name token (or its value for positional args)
    value: Token  # NAME or SIGNED_NUMBER token

    @property
    def is_number(self) -> bool:
        return self.value.type == "SIGNED_NUMBER"


def _allowed_text(allowed: Sequence[int]) -> str:
    """'a multiple of 16 from 16 to 256', 'from 1 to 8' or '16, 32 or 64'."""
    if isinstance(allowed, range):
        span = f"from {allowed.start} to {allowed[-1]}"
        return f"a multiple of {allowed.step} {span}" if allowed.step > 1 else span
    *rest, last = map(str, allowed)
    return f"{', '.join(rest)} or {last}" if rest else last


def _value_token(value_tree: Tree) -> Token:
    (child,) = value_tree.children
    return child.children[0] if isinstance(child, Tree) else child


def _trees(node: Tree):
    return [c for c in node.children if isinstance(c, Tree)]


class KernelBuilder:
    """Builds one KernelSpec from one `kernel` tree; problems go to ``errors``."""

    def __init__(self, tree: Tree, errors: _Errors, source_lines: tuple[str, ...]):
        self.tree = tree
        self.err = errors
        self.lines = source_lines
        self.locs: dict[str, SourceLoc] = {}
        self.seen: dict[str, Tree] = {}  # dotted field -> statement, for duplicate notes
        self.ok = True
        self.had_unknown = False
        self.transforms: dict[str, object] = {}  # Transforms fields the spec sets
        self.transform_toks: dict[str, Token] = {}  # the word that set each, for errors

    # ---- helpers -------------------------------------------------------
    def error(self, item, message, **kw):
        self.ok = False
        self.err.error(item, message, **kw)

    def first_time(self, key: str, stmt: Tree, what: str) -> bool:
        """False (and an error) when ``key`` was already set in this kernel."""
        if key in self.seen:
            prev = self.seen[key]
            self.error(stmt, f"{what} is set twice",
                       notes=[Note("first set here", self.err.loc(prev))],
                       hint="remove one of them")
            return False
        self.seen[key] = stmt
        return True

    def word(self, tok: Token, choices, what: str) -> Optional[str]:
        """``tok`` if it is one of ``choices``; otherwise an error with a suggestion."""
        if tok in choices:
            return str(tok)
        hint = did_you_mean(str(tok), choices)
        self.error(tok, f"unknown {what} '{tok}'; expected {one_of(choices)}", hint=hint)
        return None

    def short(self, tok: Token, what: str) -> bool:
        """False (and an error) for a number literal too long to be worth converting."""
        if len(tok) <= MAX_NUMBER_CHARS:
            return True
        self.error(tok, f"{what} is a number of {len(tok)} characters; at most {MAX_NUMBER_CHARS} are read")
        return False

    def whole(self, tok: Token, what: str) -> Optional[int]:
        """``tok`` as an int; an error if it is not an integer literal or is too long."""
        if not re.fullmatch(r"[+-]?[0-9]+", str(tok)):
            self.error(tok, f"{what} must be an integer, got '{tok}'")
            return None
        return int(tok) if self.short(tok, what) else None

    def integer(self, tok: Token, what: str, allowed: Sequence[int]) -> Optional[int]:
        """``tok`` as an int in ``allowed`` (a range or a tuple); otherwise an error saying which."""
        v = self.whole(tok, what)
        if v is not None and v not in allowed:
            self.error(tok, f"{what} must be {_allowed_text(allowed)}, got {v}")
            return None
        return v

    def real(self, tok: Token, what: str, positive: bool = False,
             bounds: Optional[tuple[float, float]] = None) -> Optional[float]:
        if tok.type != "SIGNED_NUMBER":
            self.error(tok, f"{what} must be a number, got '{tok}'")
            return None
        if not self.short(tok, what):
            return None
        v = float(tok)
        if bounds is not None and not bounds[0] <= v <= bounds[1]:
            self.error(tok, f"{what} must be from {bound_text(bounds[0])} to {bound_text(bounds[1])}, got {tok}")
            return None
        if not math.isfinite(v) or (positive and v <= 0):
            self.error(tok, f"{what} must be a {'positive ' if positive else ''}finite number, got {tok}")
            return None
        return v

    def args(self, call: Tree, params: tuple[str, ...], what: str) -> Optional[dict[str, _Arg]]:
        """Bind a call's arguments to ``params`` (positional in that order, or by name)."""
        out: dict[str, _Arg] = {}
        good = True
        named_seen = False
        positional = 0
        for a in _trees(call):
            if a.data == "named_arg":
                key, value = a.children
                named_seen = True
                if key not in params:
                    if params:
                        self.error(key, f"{what} has no parameter '{key}'; its parameters are {one_of(params)}",
                                   hint=did_you_mean(str(key), params))
                    else:
                        self.error(key, f"{what} takes no arguments")
                    good = False
                    continue
                name = str(key)
            else:
                (value,) = a.children
                key = _value_token(value)
                if named_seen:
                    self.error(key, f"positional argument after a named one in {what}")
                    good = False
                    continue
                if positional >= len(params):
                    msg = (f"{what} takes no arguments" if not params else
                           f"{what} takes at most {len(params)} argument{'s' * (len(params) > 1)} "
                           f"({', '.join(params)})")
                    self.error(key, msg)
                    good = False
                    continue
                name = params[positional]
                positional += 1
            if name in out:
                self.error(key, f"argument '{name}' of {what} is given twice")
                good = False
                continue
            out[name] = _Arg(name, key, _value_token(value))
        return out if good else None

    def name_arg(self, arg: _Arg, choices, what: str) -> Optional[str]:
        if arg.is_number:
            self.error(arg.value, f"{what} must be one of {one_of(choices)}, got '{arg.value}'")
            return None
        return self.word(arg.value, choices, what)

    # ---- kernel ---------------------------------------------------------
    def build(self) -> Optional[KernelSpec]:
        name_tok = self.tree.children[0]
        self.locs["name"] = self.err.loc(name_tok)
        f: dict[str, object] = {}
        operands: dict[str, OperandFormat] = {}
        p_via: Optional[tuple[Tree, PProduction]] = None
        schedule = None
        backward = None
        kv_cache = None

        for st in _trees(self.tree):
            kind = st.data
            if kind == "target_stmt":
                if self.first_time("target", st, "the target"):
                    (tok,) = st.children
                    v = self.word(tok, TARGETS, "target")
                    if v is not None:
                        f["target"] = Target(v)
                        self.locs["target"] = self.err.loc(tok)
            elif kind == "head_dim_stmt":
                if self.first_time("head_dim", st, "head_dim"):
                    (tok,) = st.children
                    v = self.integer(tok, "head_dim", HEAD_DIM_RANGE)
                    if v is not None:
                        f["head_dim"] = v
                        self.locs["head_dim"] = self.err.loc(tok)
            elif kind == "mask_stmt":
                if self.first_time("mask", st, "the mask"):
                    res = self.mask(st)
                    if res is not None:
                        f["mask"], f["window"] = res
                        self.locs["mask"] = self.err.loc(st.children[0])
            elif kind == "softcap_stmt":
                if self.first_time("softcap", st, "softcap"):
                    (child,) = st.children
                    tok = child.children[0] if isinstance(child, Tree) else child
                    if tok.type == "NAME":
                        if self.word(tok, ("none",), "softcap value") is not None:
                            self.locs["softcap"] = self.err.loc(tok)
                    elif tok.type == "SIGNED_NUMBER" and self.short(tok, "softcap") and float(tok) == 0:
                        self.error(tok, "softcap 0 would divide by zero", hint="write 'softcap none' (the default)")
                    else:
                        v = self.real(tok, "softcap", bounds=SOFTCAP_RANGE)
                        if v is not None:
                            f["softcap"] = v
                            self.locs["softcap"] = self.err.loc(tok)
            elif kind == "sinks_stmt":
                if self.first_time("sinks", st, "sinks"):
                    (child,) = st.children
                    tok = child.children[0] if isinstance(child, Tree) else child
                    if tok.type != "NAME":
                        self.error(tok, f"sinks takes {one_of(SINKS)}, not a count of sink tokens ('{tok}')",
                                   hint="'sinks learned' is GPT-OSS's learned per-head sink logit; for the first "
                                        "keys attended exactly beside the quantized attention write "
                                        f"'sink_tokens {tok}'")
                    else:
                        v = self.word(tok, SINKS, "sinks value")
                        if v is not None:
                            f["sinks"] = Sinks(v)
                            self.locs["sinks"] = self.err.loc(tok)
            elif kind == "layout_stmt":
                if self.first_time("layout", st, "the layout"):
                    (tok,) = st.children
                    v = self.word(tok, LAYOUTS, "layout")
                    if v is not None:
                        f["layout"] = Layout(v)
                        self.locs["layout"] = self.err.loc(tok)
            elif kind == "scale_stmt":
                if self.first_time("scale", st, "the softmax scale"):
                    (child,) = st.children
                    tok = child.children[0] if isinstance(child, Tree) else child
                    if tok.type == "NAME":
                        if self.word(tok, ("auto",), "softmax scale") is not None:
                            f["softmax_scale"] = None
                            self.locs["scale"] = self.err.loc(tok)
                    else:
                        v = self.real(tok, "the softmax scale", bounds=SOFTMAX_SCALE_RANGE)
                        if v is not None:
                            f["softmax_scale"] = v
                            self.locs["scale"] = self.err.loc(tok)
            elif kind == "guard_stmt":
                if self.first_time("guard", st, "the guard"):
                    g = self.guard(st)  # shaped like a call: NAME, then arguments
                    if g is not None:
                        f["guard"] = g
            elif kind == "rotate_stmt":
                if self.first_time("rotate", st, "the rotation"):
                    self.rotate(st)
            elif kind == "sink_tokens_stmt":
                if self.first_time("sink_tokens", st, "sink_tokens"):
                    self.sink_tokens(st)
            elif kind == "operand_stmt":
                res = self.operand(st, FORWARD_OPERANDS, "", where="kernel")
                if res is not None:
                    nm, fmt, via = res
                    operands[nm] = fmt
                    if via is not None:
                        p_via = via
            elif kind == "schedule_block":
                if self.first_time("schedule", st, "the schedule block"):
                    self.locs["schedule"] = self.err.loc(st)
                    schedule = self.schedule(st)
            elif kind == "backward_block":
                if self.first_time("backward", st, "the backward block"):
                    self.locs["backward"] = self.err.loc(st)
                    backward = self.backward(st)
            elif kind == "kv_cache_block":
                if self.first_time("kv_cache", st, "the kv_cache block"):
                    self.locs["kv_cache"] = self.err.loc(st)
                    kv_cache = self.kv_cache(st)
            elif kind in ("unknown_stmt", "unknown_block"):
                self.unknown(st, KERNEL_KEYWORDS, FORWARD_OPERANDS, "kernel")
            else:  # pragma: no cover - grammar and builder out of sync
                raise AssertionError(f"unhandled statement {kind}")

        # P's production needs P's format, wherever the two were written.
        if p_via is not None and "P" in operands:
            via_tree, prod = p_via
            pfmt = operands["P"].format
            if prod.kind is PKind.DIRECT_P and pfmt not in DIRECT_P_FORMATS:
                self.error(via_tree, f"direct_p produces mxfp4 or fp8e4m3 codes, but P is {pfmt.value}",
                           hint="make P mxfp4 or fp8e4m3, or use 'via exp'")
            elif prod.kind is PKind.TWO_LEVEL and not pfmt.is_fp4:
                self.error(via_tree, f"two_level quantizes P to FP4, but P is {pfmt.value}",
                           hint="make P nvfp4 or mxfp4, or use 'via exp'")
            f["p_production"] = prod

        if "kv_cache" in self.seen:
            self.kv_cache_conflicts()
        if self.transforms:
            self.transform_conflicts(f)

        missing = [(r, ex) for r, ex in (("target", "target sm100a"), ("head_dim", "head_dim 128"))
                   if r not in self.seen]
        if missing and not self.had_unknown:  # a misspelled 'targt' already said it
            self.error(name_tok, f"kernel '{name_tok}' does not set {' or '.join(r for r, _ in missing)}",
                       hint="add " + " and ".join(f"a line like '{ex}'" for _, ex in missing))
        if not self.ok:
            return None
        for nm, fmt in operands.items():
            f[nm.lower()] = fmt
        if schedule is not None:
            f["schedule"] = schedule
        if backward is not None:
            f["backward"] = backward
        if kv_cache is not None:
            f["kv_cache"] = kv_cache
        if self.transforms:
            f["transforms"] = Transforms(**self.transforms)
        return KernelSpec(
            name=str(name_tok), locs=MappingProxyType(dict(self.locs)),
            source_file=self.err.filename, source_lines=self.lines, **f)

    # ---- pieces -----------------------------------------------------------
    def unknown(self, st: Tree, keywords, operands, where: str):
        self.had_unknown = True
        tok = st.children[0]
        word = str(tok)
        is_block = st.data == "unknown_block"
        if word in operands and not is_block:
            self.error(tok, f"expected ':' after operand name '{word}'", hint=f"write '{word} : bf16'")
            return
        if word == "attention":
            self.error(tok, "kernels cannot be nested: is a '}' missing above?")
            return
        home = BLOCK_HOME.get(word)
        if word in KERNEL_KEYWORDS and where != "kernel":
            self.error(tok, f"'{word}' belongs directly in the attention block, not in {where}")
            return
        if home is not None and home != where:
            self.error(tok, f"'{word}' belongs in a {home} {{ }} block")
            return
        if word in BACKWARD_OPERANDS and where == "kernel":
            self.error(tok, f"gradient operand '{word}' belongs in a backward {{ }} block")
            return
        if word in FORWARD_OPERANDS and where == "backward":
            self.error(tok, f"forward operand '{word}' belongs directly in the attention block")
            return
        if where == "kv_cache" and word in FORWARD_OPERANDS:
            self.error(tok, f"the cache's format is one 'format' line for K and V, not '{word} :'",
                       hint="write e.g. 'format fp8e4m3(scale=token)'")
            return
        if where == "schedule" and word == "tmem":
            self.error(tok, "tmem takes 'auto' or a block of regions like 'tmem { S0 cols 0..127 }'")
            return
        choices = list(keywords) + list(operands)
        what = "block" if is_block else "statement"
        blocks = {"kernel": "attention", "schedule": "schedule", "backward": "backward",
                  "kv_cache": "kv_cache"}.get(where, where)
        self.error(tok, f"unknown {what} '{word}' in {blocks} block",
                   hint=did_you_mean(word, choices) or f"expected {one_of(choices)}")

    def operand(self, st: Tree, allowed, prefix: str, where: str):
        name_tok, call, via, *options = st.children
        name = str(name_tok)
        key = prefix + name
        if name not in allowed:
            if where == "kernel" and name in BACKWARD_OPERANDS:
                self.error(name_tok, f"gradient operand '{name}' belongs in a backward {{ }} block")
            elif where == "backward" and name in FORWARD_OPERANDS:
                self.error(name_tok, f"forward operand '{name}' is set in the attention block, "
                           "not in backward")
            else:
                kind = "gradient operand" if where == "backward" else "operand"
                self.error(name_tok, f"unknown {kind} '{name}'; expected {one_of(allowed)}",
                           hint=did_you_mean(name, allowed))
            return None
        if not self.first_time(key, st, f"the format of {name}"):
            return None
        fmt = self.format(call, key)
        prod = None
        if via is not None:
            via_call = via.children[0]
            if name != "P":
                self.error(via, f"only P takes 'via' (how P is produced), not {name}")
                fmt = None
            else:
                prod = self.production(via_call)
                if prod is None:
                    fmt = None
                else:
                    self.locs["P.via"] = self.err.loc(via_call.children[0])
        if fmt is not None and where == "backward" and fmt.format.is_fp4:
            # no backend computes gradients in FP4 (the reference would silently skip the rounding)
            self.error(call.children[0], f"gradient operand {name} cannot be {fmt.format.value}",
                       hint="gradients are fp8e4m3, fp8e5m2, bf16, fp16 or fp32")
            fmt = None
        if fmt is None:
            return None
        if options and not self.operand_options(name, options, where):
            return None
        self.locs[key] = self.err.loc(call.children[0])
        return name, fmt, ((via, prod) if prod is not None else None)

    # ---- outlier transforms (issue 21) --------------------------------------------------
    def operand_options(self, name: str, options, where: str) -> bool:
        """The words after an operand's format: ``K : ... smooth``, ``V : ... channel_scale``."""
        good = True
        for opt in options:
            tok = opt.children[0]
            word = str(tok)
            if where != "kernel":
                self.error(tok, f"'{word}' after a gradient's format: the outlier transforms are options of the "
                                "forward operands K and V",
                           hint="their gradients follow through autograd; drop the word here")
                good = False
                continue
            if word == "sink_tokens":
                self.error(tok, f"sink_tokens is a statement of the attention block (it takes keys out of K and V "
                                f"together), not an option of {name}",
                           hint="write 'sink_tokens 1' on a line of its own")
                good = False
                continue
            if word not in OPERAND_OPTIONS:
                valid = [w for w, (op, _) in OPERAND_OPTIONS.items() if op == name]
                if valid:
                    self.error(tok, f"unknown option '{word}' of {name}; expected {one_of(valid)}",
                               hint=did_you_mean(word, list(OPERAND_OPTIONS)))
                else:
                    self.error(tok, f"unknown word '{word}' after {name}'s format; {name} takes no options "
                                    f"(K takes 'smooth', V 'channel_scale')",
                               hint=did_you_mean(word, list(OPERAND_OPTIONS)))
                good = False
                continue
            op, field = OPERAND_OPTIONS[word]
            if op != name:
                why = ("K smoothing subtracts K's mean over tokens (softmax ignores a per-row shift)"
                       if word == "smooth" else "per-channel V scales are undone on O's columns")
                self.error(tok, f"'{word}' is an option of {op}, not {name}: {why}",
                           hint=f"write it on the {op} line: '{op} : fp8e4m3 {word}'")
                good = False
                continue
            key = f"{name}.{word}"
            if key in self.locs:
                self.error(tok, f"'{word}' is written twice on {name}'s line")
                good = False
                continue
            self.transforms[field] = True
            self.transform_toks[field] = tok
            self.locs[key] = self.err.loc(tok)
        return good

    def rotate(self, st: Tree) -> None:
        """``rotate qk hadamard[(seed=N)]``: Q and K times one orthonormal Hadamard matrix."""
        what, call = st.children
        if str(what) != "qk":
            self.error(what, f"rotate applies to 'qk' (Q and K by the same matrix, so that Q K^T is unchanged), "
                             f"not '{what}'", hint="write 'rotate qk hadamard(seed=0)'")
            return
        tok = call.children[0]
        if self.word(tok, ROTATIONS, "rotation") is None:
            return
        args = self.args(call, ("seed",), "hadamard")
        if args is None:
            return
        seed = None
        if "seed" in args:
            seed = self.integer(args["seed"].value, "hadamard's seed", HADAMARD_SEED_RANGE)
            if seed is None:
                return
            self.locs["rotate.seed"] = self.err.loc(args["seed"].key)
        self.transforms["hadamard"] = True
        self.transforms["hadamard_seed"] = seed
        self.transform_toks["hadamard"] = tok
        self.locs["rotate"] = self.err.loc(tok)

    def sink_tokens(self, st: Tree) -> None:
        """``sink_tokens N``: the first N keys left out of the quantized attention and attended
        exactly beside it (``sink_tokens none``: the default, no transform)."""
        (child,) = st.children
        tok = child.children[0] if isinstance(child, Tree) else child
        what = "sink_tokens"
        if tok.type == "NAME":
            if str(tok) == "learned":
                self.error(tok, "sink_tokens takes a count of leading keys, not 'learned'",
                           hint="a learned sink logit per head is 'sinks learned'")
            elif self.word(tok, ("none",), "sink_tokens value") is not None:
                self.locs["sink_tokens"] = self.err.loc(tok)
            return
        if not self.short(tok, what):
            return
        if re.fullmatch(r"[+-]?0+", str(tok)):
            self.error(tok, "sink_tokens 0 attends no key exactly", hint="write 'sink_tokens none' (the default) "
                                                                       "or drop the line")
            return
        n = self.integer(tok, what, SINK_TOKENS_RANGE)
        if n is None:
            return
        self.transforms["sink_tokens"] = n
        self.transform_toks["sink_tokens"] = tok
        self.locs["sink_tokens"] = self.err.loc(tok)

    def transform_conflicts(self, f: dict) -> None:
        """What ``numerics.outliers.apply`` refuses, at the transform's line: each transform must
        leave the attention unchanged (in real arithmetic)."""
        if "smooth_k" in self.transform_toks:
            tok = self.transform_toks["smooth_k"]
            for field, present, why in (
                    ("softcap", bool(f.get("softcap")),
                     "softcap's tanh does not ignore the per-row shift smoothing adds to the scores"),
                    ("sinks", f.get("sinks", Sinks.NONE) is not Sinks.NONE,
                     "smoothing shifts every key's logit but not the sink's")):
                if present:
                    self.error(tok, f"K smoothing with {field}: {why}, so the attention would change",
                               notes=[Note(f"{field} set here", self.locs[field])],
                               hint=f"drop 'smooth' or the {field} line")
        if "hadamard" in self.transform_toks:
            d = f.get("head_dim")
            if d is not None and d & (d - 1):
                self.error(self.transform_toks["hadamard"],
                           f"the Hadamard rotation needs a power-of-two head dim, got {d}",
                           notes=[Note("head_dim set here", self.locs["head_dim"])],
                           hint="head_dim 64, 128 or 256, or drop the rotate line")
        if "sink_tokens" in self.transform_toks and f.get("layout", Layout.DENSE) is Layout.VARLEN:
            self.error(self.transform_toks["sink_tokens"],
                       "sink_tokens with layout varlen is not built: the first keys of every packed sequence "
                       "would leave the kernel's keys (new cu_seqlens_k) and be merged per sequence",
                       notes=[Note("layout set here", self.locs["layout"])],
                       hint="drop the sink_tokens line, or use layout dense")
        if "kv_cache" in self.seen:
            for field, tok in self.transform_toks.items():
                word = f"sink_tokens {tok}" if field == "sink_tokens" else str(tok)
                self.error(tok, f"'{word}' with a kv_cache block: the outlier transforms run around prefill "
                                "attention (fp4gen.attention), not against a KV cache",
                           hint="drop it, or the kv_cache block")

    def format(self, call: Tree, key: str) -> Optional[OperandFormat]:
        tok = call.children[0]
        fname = self.word(tok, ELEMENT_FORMATS, "format")
        if fname is None:
            return None
        fmt = Format(fname)
        args = self.args(call, ("block", "scale"), fname)
        if args is None:
            return None
        block = args.get("block")
        scale = args.get("scale")
        for a in args.values():
            self.locs[f"{key}.{a.name}"] = self.err.loc(a.key)
        if fmt.is_high_precision:
            if args:
                first = next(iter(args.values()))
                self.error(first.key, f"{fname} takes no block or scale: it is not scaled")
                return None
            return OperandFormat(fmt)
        scale_w = self.name_arg(scale, SCALE_WORDS, "scale") if scale is not None else None
        if scale is not None and scale_w is None:
            return None
        block_n = None
        if block is not None:
            if fmt.is_fp4:  # the one size each FP4 format has is checked below, with a hint
                block_n = self.whole(block.value, "block")
            elif scale_w == "e8m0":
                block_n = self.integer(block.value, f"the block of {fname} with e8m0 scales (OCP MX)", (MX_BLOCK,))
            else:
                block_n = self.integer(block.value, f"the block of {fname}", FP8_TOKEN_BLOCKS)
            if block_n is None:
                return None
        if fmt.is_fp4:
            # The two FP4 formats are defined by their block size and scale type.
            std = default_operand_format(fmt)
            if block_n is not None and block_n != std.block:
                other = "mxfp4" if fmt is Format.NVFP4 else "nvfp4"
                self.error(block.value, f"{fname} uses blocks of {std.block} elements, not {block_n}",
                           hint=f"for blocks of {default_operand_format(Format(other)).block} use {other}")
                return None
            if scale_w is not None and scale_w != std.scale.value:
                self.error(scale.value, f"{fname} block scales are {std.scale.value}, not {scale_w}")
                return None
            return std
        # fp8: per tensor (default), per token, per block, or unscaled
        if block_n is not None:
            sw = scale_w or "fp32"
            if sw not in ("fp32", "e8m0"):
                self.error(scale.value, f"a per-block scale of {fname} is fp32 or e8m0, not {sw}",
                           hint=f"drop block= for scale={sw}" if sw in ("tensor", "token") else None)
                return None
            return OperandFormat(fmt, ScaleGranularity.BLOCK, block_n, Format(sw))
        sw = scale_w or "tensor"
        if sw in ("fp32", "e8m0", "e4m3"):
            self.error(scale.value, f"scale={sw} needs a block size",
                       hint=f"write {fname}(block={MX_BLOCK if sw == 'e8m0' else 128}, scale={sw}), "
                            "or scale=tensor for one fp32 scale per tensor")
            return None
        if sw == "none":
            return OperandFormat(fmt, ScaleGranularity.NONE, None, None)
        return OperandFormat(fmt, ScaleGranularity(sw), None, Format.FP32)

    def production(self, call: Tree) -> Optional[PProduction]:
        tok = call.children[0]
        kind = self.word(tok, P_KINDS, "way to produce P")
        if kind is None:
            return None
        if kind != "direct_p":
            return PProduction(kind=PKind(kind)) if self.args(call, (), kind) is not None else None
        args = self.args(call, ("policy", "a", "b"), "direct_p")
        if args is None:
            return None
        prod = PProduction(kind=PKind.DIRECT_P)
        kw = {}
        if "policy" in args:
            v = self.name_arg(args["policy"], POLICIES, "policy")
            if v is None:
                return None
            kw["policy"] = DirectPPolicy(v)
        for p, bounds in (("a", DIRECT_P_A_RANGE), ("b", DIRECT_P_B_RANGE)):
            if p in args:
                v = self.real(args[p].value, f"direct_p's {p}", bounds=bounds)
                if v is None:
                    return None
                kw[p] = v
        for a in args.values():
            self.locs[f"P.via.{a.name}"] = self.err.loc(a.key)
        return PProduction(kind=PKind.DIRECT_P, **kw) if kw else prod

    def mask(self, st: Tree) -> Optional[tuple[Mask, Optional[tuple[int, int]]]]:
        """(mask, window) of `mask none | causal | window(left, right)`; window sizes follow
        FlashAttention's window_size (-1 = unbounded), and window(-1, -1) / window(-1, 0) are
        the masks none / causal (``mask_for_window``)."""
        tok = st.children[0]
        kind = self.word(tok, MASKS, "mask")
        if kind is None:
            return None
        if kind != "window":
            return (Mask(kind), None) if self.args(st, (), f"mask {kind}") is not None else None
        args = self.args(st, ("left", "right"), "window")
        if args is None:
            return None
        missing = [p for p in ("left", "right") if p not in args]
        if missing:
            self.error(tok, f"window needs {' and '.join(missing)}",
                       hint="e.g. 'mask window(128, 0)': 128 keys before the diagonal, none after (-1 = unbounded)")
            return None
        sizes = []
        for p in ("left", "right"):
            v = self.whole(args[p].value, f"window {p}")
            if v is None:
                return None
            if v not in WINDOW_RANGE:
                self.error(args[p].value, f"window {p} must be -1 (unbounded) or a key count from 0 to "
                                          f"{WINDOW_RANGE[-1]}, got {v}")
                return None
            sizes.append(v)
            self.locs[f"mask.{p}"] = self.err.loc(args[p].key)
        return mask_for_window(sizes[0], sizes[1])

    def guard(self, call: Tree) -> Optional[Guard]:
        tok = call.children[0]
        kind = self.word(tok, GUARDS, "guard")
        if kind is None:
            return None
        if kind == "none":
            if self.args(call, (), "guard none") is None:
                return None
            self.locs["guard"] = self.err.loc(tok)
            return Guard()
        args = self.args(call, ("m", "l"), "guard sample")
        if args is None:
            return None
        missing = [p for p in ("m", "l") if p not in args]
        if missing and not self.had_unknown:  # a misspelled 'targt' already said it
            self.error(tok, f"guard sample needs {' and '.join(missing)}",
                       hint="e.g. 'guard sample(m=110, l=16)' (the paper's Algorithm 3 constants)")
            return None
        m = self.integer(args["m"].value, "guard m", GUARD_M_RANGE)
        l = self.integer(args["l"].value, "guard l", GUARD_L_RANGE)
        if m is None or l is None:
            return None
        self.locs["guard"] = self.err.loc(tok)
        self.locs["guard.m"] = self.err.loc(args["m"].key)
        self.locs["guard.l"] = self.err.loc(args["l"].key)
        return Guard(GuardKind.SAMPLE, m, l)

    def schedule(self, block: Tree) -> Optional[Schedule]:
        kw: dict[str, object] = {}
        ok = self.ok
        self.ok = True
        for st in _trees(block):
            kind = st.data
            if kind == "tile_stmt":
                if self.first_time("schedule.tile", st, "the tile"):
                    mt, _, nt = st.children
                    m = self.integer(mt, "tile M", TILE_RANGE)
                    n = self.integer(nt, "tile N", TILE_RANGE)
                    if m is not None and n is not None:
                        kw["tile_m"], kw["tile_n"] = m, n
                        self.locs["schedule.tile"] = self.err.loc(mt)
            elif kind in ("q_stages_stmt", "kv_stages_stmt"):
                field = kind[: -len("_stmt")]
                if self.first_time(f"schedule.{field}", st, field):
                    (tok,) = st.children
                    if tok.type == "NAME":
                        if field == "kv_stages" and self.word(tok, ("auto",), "kv_stages value") is not None:
                            kw["kv_stages"] = None
                            self.locs["schedule.kv_stages"] = self.err.loc(tok)
                        elif field == "q_stages":
                            self.error(tok, f"q_stages must be an integer, got '{tok}'")
                    else:
                        v = self.integer(tok, field, Q_STAGES_RANGE if field == "q_stages" else KV_STAGES_RANGE)
                        if v is not None:
                            kw[field] = v
                            self.locs[f"schedule.{field}"] = self.err.loc(tok)
            elif kind == "p_publish_stmt":
                if self.first_time("schedule.p_publish", st, "p_publish"):
                    (tok,) = st.children
                    v = self.word(tok, PUBLISH, "p_publish mode")
                    if v is not None:
                        kw["p_publish"] = PPublish(v)
                        self.locs["schedule.p_publish"] = self.err.loc(tok)
            elif kind == "p_source_stmt":
                if self.first_time("schedule.p_source", st, "p_source"):
                    (tok,) = st.children
                    v = self.word(tok, P_SOURCES, "p_source value")
                    if v is not None:
                        kw["p_source"] = PSource(v)
                        self.locs["schedule.p_source"] = self.err.loc(tok)
            elif kind == "tmem_auto_stmt":
                if self.first_time("schedule.tmem", st, "tmem"):
                    (tok,) = st.children
                    if self.word(tok, ("auto",), "tmem setting") is not None:
                        kw["tmem_regions"] = None
                        self.locs["schedule.tmem"] = self.err.loc(tok)
            elif kind == "tmem_block":
                if self.first_time("schedule.tmem", st, "tmem"):
                    regions = self.tmem_regions(st)
                    if regions is not None:
                        kw["tmem_regions"] = regions
                        self.locs["schedule.tmem"] = self.err.loc(st)
            else:
                self.unknown(st, SCHEDULE_KEYWORDS, (), "schedule")
        good = self.ok
        self.ok = ok and good
        return Schedule(**kw) if good else None

    def tmem_regions(self, block: Tree):
        regions = []
        first: dict[str, Tree] = {}
        for st in _trees(block):
            name, a, b = st.children
            if name in first:
                self.error(name, f"tmem region '{name}' is listed twice",
                           notes=[Note("first listed here", self.err.loc(first[name]))])
                continue
            first[str(name)] = st
            lo = self.integer(a, "first column", range(TMEM_COLUMNS))
            hi = self.integer(b, "last column", range(TMEM_COLUMNS))
            if lo is None or hi is None:
                continue
            if hi < lo:
                self.error(a, f"region '{name}' ends (column {hi}) before it starts (column {lo})",
                           span=len(a) + 2 + len(b))
                continue
            self.locs[f"schedule.tmem.{name}"] = self.err.loc(name)
            regions.append(TmemRegionRequest(str(name), lo, hi))
        if not regions and not first:
            self.error(block, "empty tmem block", hint="list regions like 'S0 cols 0..127', or write 'tmem auto'")
            return None
        return tuple(regions)

    def backward(self, block: Tree) -> Optional[Backward]:
        ok = self.ok
        self.ok = True
        kw: dict[str, object] = {}
        formats: dict[str, OperandFormat] = {}
        for st in _trees(block):
            kind = st.data
            if kind == "reuse_stmt":
                if not self.first_time("backward.reuse", st, "reuse"):
                    continue
                toks = list(st.children)
                if len(toks) == 1 and toks[0] == "none":
                    kw["reuse"] = frozenset()
                    self.locs["backward.reuse"] = self.err.loc(st)
                    continue
                if not toks:
                    self.error(st, "reuse lists forward state to reuse",
                               hint=f"e.g. 'reuse q k lse', from {one_of(REUSABLE_STATE)}; or 'reuse none'")
                    continue
                got = []
                for t in toks:
                    v = self.word(t, REUSABLE_STATE, "reusable state")
                    if v is None:
                        continue
                    if v in got:
                        self.error(t, f"'{v}' is listed twice")
                        continue
                    got.append(v)
                kw["reuse"] = frozenset(got)
                self.locs["backward.reuse"] = self.err.loc(st)
            elif kind == "deterministic_stmt":
                if self.first_time("backward.deterministic", st, "deterministic"):
                    (tok,) = st.children
                    v = self.word(tok, ("true", "false"), "value for deterministic")
                    if v is not None:
                        kw["deterministic"] = v == "true"
                        self.locs["backward.deterministic"] = self.err.loc(tok)
            elif kind == "operand_stmt":
                res = self.operand(st, BACKWARD_OPERANDS, "backward.", where="backward")
                if res is not None:
                    formats[res[0]] = res[1]
            else:
                self.unknown(st, BACKWARD_KEYWORDS, BACKWARD_OPERANDS, "backward")
        good = self.ok
        self.ok = ok and good
        if not good:
            return None
        ordered = {n: formats[n] for n in BACKWARD_OPERANDS if n in formats}
        return Backward(formats=MappingProxyType(ordered), **kw)


    # ---- kv_cache { ... } ------------------------------------------------------------------
    def kv_cache(self, block: Tree) -> Optional[KvCache]:
        """The kv_cache block: storage, the cache's format (for K and V), q_tokens, gqa."""
        ok = self.ok
        self.ok = True
        kw: dict[str, object] = {}
        for st in _trees(block):
            kind = st.data
            if kind == "storage_stmt":
                if self.first_time("kv_cache.storage", st, "the cache storage"):
                    res = self.kv_storage(st)
                    if res is not None:
                        kw["storage"], kw["page_size"] = res
                        self.locs["kv_cache.storage"] = self.err.loc(st.children[0])
            elif kind == "cache_format_stmt":
                if self.first_time("kv_cache.format", st, "the cache format"):
                    fmt = self.cache_format(st)
                    if fmt is not None:
                        kw["format"] = fmt
                        self.locs["kv_cache.format"] = self.err.loc(st.children[0])
            elif kind in ("q_tokens_stmt", "gqa_stmt"):
                field = kind[: -len("_stmt")]
                if self.first_time(f"kv_cache.{field}", st, field):
                    (tok,) = st.children
                    allowed = KV_Q_TOKENS_RANGE if field == "q_tokens" else KV_GQA_RANGE
                    what = ("q_tokens (query tokens per sequence per step)" if field == "q_tokens"
                            else "gqa (query heads per KV head)")
                    v = self.integer(tok, what, allowed)
                    if v is not None:
                        kw[field] = v
                        self.locs[f"kv_cache.{field}"] = self.err.loc(tok)
            elif kind == "operand_stmt":
                name = st.children[0]
                self.error(name, f"the cache's format is one 'format' line for K and V, not '{name} :'",
                           hint="write e.g. 'format fp8e4m3(scale=token)'")
            else:
                self.unknown(st, KV_CACHE_KEYWORDS, (), "kv_cache")
        good = self.ok
        self.ok = ok and good
        return KvCache(**kw) if good else None

    def kv_storage(self, st: Tree) -> Optional[tuple[KvStorage, Optional[int]]]:
        tok = st.children[0]
        kind = self.word(tok, KV_STORAGES, "cache storage")
        if kind is None:
            return None
        if kind == "contiguous":
            return (KvStorage.CONTIGUOUS, None) if self.args(st, (), "contiguous") is not None else None
        args = self.args(st, ("page_size",), "paged")
        if args is None:
            return None
        if "page_size" not in args:
            self.error(tok, "paged needs page_size", hint="e.g. 'storage paged(page_size=64)'")
            return None
        a = args["page_size"]
        v = self.whole(a.value, "page_size")
        if v is None:
            return None
        if v not in KV_PAGE_SIZES:
            why = ("not a power of two" if v > 0 and v & (v - 1) else
                   f"a page holds at least one 16-key step of the PV MMA" if v < KV_PAGE_SIZES[0]
                   else "larger pages would only waste the tail of each sequence's last one")
            self.error(a.value, f"page_size must be a power of two from {KV_PAGE_SIZES[0]} to {KV_PAGE_SIZES[-1]}, "
                                f"got {v} ({why})")
            return None
        self.locs["kv_cache.page_size"] = self.err.loc(a.key)
        return KvStorage.PAGED, v

    def cache_format(self, st: Tree) -> Optional[CacheFormat]:
        """bf16 | fp8e4m3(scale=tensor|token) | nvfp4(block=16, scale=e4m3, tensor_scale=fp32|none):
        formats whose scales are fixed when a token is written (CacheFormat)."""
        tok = st.children[0]
        if tok in ELEMENT_FORMATS and tok not in KV_FORMATS:
            self.error(tok, f"a KV cache holds {one_of(KV_FORMATS)}, not {tok}")
            return None
        name = self.word(tok, KV_FORMATS, "cache format")
        if name is None:
            return None
        fmt = Format(name)
        if fmt is Format.BF16:
            return CacheFormat() if self.args(st, (), "bf16") is not None else None
        if fmt is Format.FP8E4M3:
            args = self.args(st, ("scale", "block"), "fp8e4m3 in a cache")
            if args is None:
                return None
            if "block" in args:
                self.error(args["block"].key, "a KV cache's fp8 scale cannot cover a block of tokens: it would "
                                              "change as tokens are appended",
                           hint="write scale=token (one fp32 scale per token and KV head) or scale=tensor "
                                "(one per KV head, fixed at allocation)")
                return None
            g = "tensor"
            if "scale" in args:
                g = self.name_arg(args["scale"], ("tensor", "token"), "fp8e4m3 cache scale")
                if g is None:
                    return None
            return CacheFormat(fmt, ScaleGranularity(g))
        args = self.args(st, ("block", "scale", "tensor_scale"), "nvfp4 in a cache")
        if args is None:
            return None
        if "block" in args and self.integer(args["block"].value, "the block of nvfp4", (16,)) is None:
            return None
        if "scale" in args and self.name_arg(args["scale"], ("e4m3",), "nvfp4 block scale") is None:
            return None
        two = False
        if "tensor_scale" in args:
            w = self.name_arg(args["tensor_scale"], ("fp32", "none"), "nvfp4 tensor_scale")
            if w is None:
                return None
            two = w == "fp32"
        return CacheFormat(fmt, ScaleGranularity.BLOCK, two)

    def kv_cache_conflicts(self) -> None:
        """What a kv_cache block rules out in the rest of the kernel: K and V are the cache's (its
        format line), the batch is the cache's sequences (not layout varlen), decode is inference
        (no backward block)."""
        for name in ("K", "V"):
            if name in self.seen:
                self.error(self.seen[name], f"with a kv_cache block, {name} is read from the cache in its format",
                           hint=f"drop the '{name} :' line; set the cache's format with 'format ...' in kv_cache")
        if "layout" in self.seen and self.locs.get("layout") is not None:
            lay = self.seen["layout"].children[0]
            if str(lay) == Layout.VARLEN.value:
                self.error(lay, "layout varlen with a kv_cache block: the batch is the cache's sequences "
                                "(cache_seqlens, page_table), not packed cu_seqlens",
                           hint="drop the layout line")
        if "backward" in self.seen:
            self.error(self.seen["backward"], "a kv_cache spec is decode (inference): it has no backward",
                       hint="drop the backward block")

def build_specs(tree: Tree, filename: str, source_lines: tuple[str, ...], skip_lines=frozenset()):
    """All kernels of a parsed file -> (specs, diagnostics).

    Kernels that contain a line in ``skip_lines`` (lines with syntax errors)
    are skipped.
    """
    errors = _Errors(filename)
    specs: list[KernelSpec] = []
    names: dict[str, Token] = {}
    for k in _trees(tree):
        name = k.children[0]
        if any(k.meta.line <= ln <= k.meta.end_line for ln in skip_lines):
            continue
        if name in names:
            errors.error(name, f"kernel '{name}' is defined twice",
                         notes=[Note("first defined here", errors.loc(names[name]))],
                         hint="kernel names must be unique within a file (they name the generated modules)")
            continue
        names[str(name)] = name
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)) or str(name).startswith("__"):
            errors.error(name, f"'{name}' cannot name a kernel")
            continue
        spec = KernelBuilder(k, errors, source_lines).build()
        if spec is not None:
            specs.append(spec)
    return specs, errors.diags
