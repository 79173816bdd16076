"""The OpenMP runtime PyTorch runs its intra-op threads on (libgomp), seen from a server.

libgomp keeps a pool of worker threads per thread that has started a parallel region, and counts
every pooled thread as *managed*. While the managed threads outnumber the CPUs it cuts the time
its idle workers spin before sleeping to a few iterations (``gomp_throttled_spin_count_var``),
so each parallel op has to wake its workers through the kernel first. ``kvledger serve`` loads
the model in the main thread (a pool of ``num_threads - 1`` workers) and steps the engine in
its own thread (a second pool): on 2 CPUs that makes 3 managed threads, and every torch op and
kernel of a step pays the wake-up. Measured on a 2-core AMD EPYC (torch 2.13.0): one int8
weight-only matmul row (1,536 x 576) 21 us in the main thread, 53 us in a second thread, 24 us
there once the main thread's pool is freed; a batch-1 decode step 15.4 ms vs 38.2 ms.

:func:`release_thread_pool` frees the calling thread's pool with OpenMP 5.0's
``omp_pause_resource_all(omp_pause_soft)`` (libgomp since GCC 9; the pool comes back if that
thread starts another parallel region).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("kvledger.engine")
OMP_PAUSE_SOFT = 1  # omp_pause_soft of omp.h's omp_pause_resource_t (OpenMP 5.0)


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool; True when the runtime did.

    Call it from a thread that has run torch ops and will leave the computing to another
    thread (the server's main thread, before it starts the engine thread). Never raises: a
    runtime without the call (not libgomp, or older than OpenMP 5.0) is logged and left alone.
    """
    try:
        pause = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError) as exc:
        log.info("OpenMP thread pool left as it is (%s)", exc)
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
