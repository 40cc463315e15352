"""Numerics: exact FP4/FP8 formats, block quantizers, P production (Direct-P, two-level,
guard) and the reference attention backend. See docs/numerics.md.

    from fp4gen.numerics.formats import E2M1, E4M3, E5M2, encode, decode, encode_e8m0, decode_e8m0
    from fp4gen.numerics.quant import quantize_nvfp4, quantize_mxfp4, quantize_fp8_blockwise, ...
    from fp4gen.numerics.reference import forward, backward, forward_varlen, backward_varlen, sinks_grad
    from fp4gen.numerics.exact import attention, attention_varlen   # the float64 oracle
    from fp4gen.numerics.masking import allowed, softcap, segments   # window / softcap / varlen rules
    from fp4gen.numerics.accuracy import report

(Submodules are not imported here so that ``fp4gen.numerics.formats`` stays light.)
"""
