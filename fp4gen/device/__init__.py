"""Shared CuTe DSL device code that generated kernels import.

Everything here is plain importable Python holding ``@cute.jit`` helpers (and
``dsl_user_op`` PTX wrappers). Generated modules import this package; it never
imports the compiler (IR, templates, jinja2).

- ``ptx``: tiny side-effect-free PTX wrappers (ex2, byte permute, e4m3 packing).
- ``layout``: views of Hopper wgmma accumulators as (rows, cols) and the P
  operand packing (BF16 and the FP8 register order + V key permutation).
- ``softmax``: the online-softmax row pieces (row max, rescale, finalize, LSE).
- ``directp``: FP8 Direct-P -- E4M3 codes of P from plain float arithmetic,
  and the exact normaliser from those codes (no MUFU.EX2). Target-neutral math.
- ``mask``: causal / sequence-length masking of a score tile.
"""
