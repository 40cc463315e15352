"""How the kernels set up their CuTe DSL pipelines (mbarrier rings), one home for both targets.

- ``coop(n)``: the cooperative group of ``n`` threads a pipeline end is made of.
- ``participants(kind, barrier, producer, consumer, ...)``: a pipeline of class ``kind``
  (``PipelineTmaUmma``, ``PipelineUmmaAsync``, ``PipelineAsyncUmma``, ...) on the SMEM
  mbarrier array ``barrier`` (a ``Storage`` field), as its (producer, consumer) participant
  handles: the sm100a kernels' form.
- ``stage_pipelines(kind, barrier, stages, producer, consumer, ...)``: one such pipeline per
  query stage on consecutive slices of one mbarrier array, and ``stage_view`` to address the
  slice of a stage chosen at run time (one traced body serves every stage).
- ``tma_pipelines(consumer_threads, *loads)``: the sm90a kernels' load pipelines, one
  ``PipelineTmaAsync`` per load from one TMA thread to the MMA warps, initialised together
  (deferred sync, one mbarrier init fence and CTA barrier for all).

Plain Python called while tracing: the same CuTe DSL calls in the same order as the code each
kernel had inline, so its PTX is unchanged (``scripts/ptx_fingerprint.py``).
"""
from __future__ import annotations

import dataclasses

import cutlass.cute as cute
import cutlass.pipeline as pipeline


def coop(n: int):
    return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)


def participants(kind, barrier, producer, consumer, *, stages: int = 1, **create):
    """(producer, consumer) handles of a ``kind`` pipeline of ``stages`` stages whose mbarriers
    are the SMEM array ``barrier``; ``create`` passes the rest (``tx_count`` for TMA loads)."""
    # CuTe's checker reports C3 "arrive count may not match the mbarrier.init count" here for
    # callers whose arriving side is a multi-warp group behind a warp-ID guard (the sm100a
    # backward's `wg` pipelines: `warp < 4` selects four warps, 128 threads = the init count; its
    # note at the call site says so). Triaged 2026-12-02: not a defect; a caller with a new
    # group must check its own count.
    return kind.create(barrier_storage=barrier.data_ptr(), num_stages=stages, producer_group=producer,
                       consumer_group=consumer, **create).make_participants()


def stage_pipelines(kind, barrier, q_stages: int, producer, consumer, *, stages: int = 1, **create):
    """One ``kind`` pipeline of ``stages`` stages per query stage j, on the mbarriers
    ``barrier + 2 * stages * j`` (full then empty barriers of each), initialised in order."""
    # CuTe's checker may report C3 "arrive count may not match the mbarrier.init count
    # (effective count: 32)" here for a 128-thread side behind a warp-ID guard that selects
    # several warps (the sm100a forward's: each stage's four softmax warps, the four correction
    # warps). Triaged 2026-12-07: not a defect; a caller with a new group checks its own count.
    return [kind.create(barrier_storage=barrier.data_ptr() + 2 * stages * j, num_stages=stages,
                        producer_group=producer, consumer_group=consumer, **create)
            for j in range(q_stages)]


def stage_view(pipes, j):
    """The pipeline of query stage ``j`` (an Int32 known only at run time) of ``stage_pipelines``'
    list, as a view of stage 0's that addresses stage j's mbarriers: no init (stage j's barriers
    were initialised with the list). Each role of a kernel whose stage is its warp's then traces
    one body for every stage, not one per stage."""
    first = pipes[0]
    words = 2 * first.num_stages * j

    def moved(sync):
        view = sync.recast_to_new_op_type(sync.op_type)  # a copy that initialises nothing
        view.barrier_storage = sync.barrier_storage + words
        view.mbarrier_base = view.barrier_storage
        return view

    return dataclasses.replace(first, sync_object_full=moved(first.sync_object_full),
                               sync_object_empty=moved(first.sync_object_empty))


def tma_pipelines(consumer_threads: int, *loads):
    """One TMA load pipeline per ``(barrier, stages, tx_count)`` in ``loads``: produced by one
    thread (the TMA warp's elected one), consumed by the ``consumer_threads // 32`` MMA warps.
    Their inits are deferred and published together: one ``mbarrier_init_fence`` and one
    ``sync_threads`` after the last. Returns the ``PipelineTmaAsync`` objects in order."""
    tma_thread = coop(1)
    mma_warps = coop(consumer_threads // 32)  # counted in warps, as both kernels had it
    pipes = [pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier.data_ptr(), num_stages=stages, producer_group=tma_thread,
        consumer_group=mma_warps, tx_count=tx_count, defer_sync=True)
        for barrier, stages, tx_count in loads]
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return pipes
