"""sm100a-only device helpers (CuTe DSL): Direct-P into MXFP4 (``direct_p``)."""
