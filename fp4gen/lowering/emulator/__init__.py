"""A CPU emulator of one sm100a CTA, driven by the compiled PTX (issue 16, items 3 and 4).

The emulator executes the PTX that CuTe DSL emits for a generated sm100a kernel: addresses,
descriptors, layouts and bit packing all come from the kernel's own instructions (and, for
TMA, from the tensor maps its host code describes), never from the plan, so a kernel that
disagrees with its plan computes the wrong O. The semantics of each tensor-memory operation
come from the PTX ISA; every rule names the ISA section it implements.

Modules, in pipeline order:

* ``ptx``     -- parse a PTX module into instructions, labels and parameters
* ``machine`` -- run one CTA: threads/warps, registers, predicates, shared memory,
                 mbarriers, named barriers; calls ``tensor``/``tma`` for async operations
* ``tensor``  -- tensor memory (TMEM) and the tcgen05 operations: ld/st/cp/mma/commit,
                 the SMEM matrix descriptor and its swizzles, block scale factors
* ``tma``     -- tensor maps and ``cp.async.bulk.tensor`` tile loads
* ``trace``   -- the synchronisation trace a run records (input of ``..protocol``)
* ``run``     -- feed a generated module's prepared operands, run, compare with the reference
"""
