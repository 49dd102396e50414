"""The task trace of the one-launch decode kernel's instrumented twin (``compile_decode(..., trace=True)``): what
each task records and the two clocks it reads.  :mod:`cute_moe.lab.trace_decode` runs it and reads the trace.
This module imports nothing of the package.
"""

import cutlass
from cutlass._mlir.dialects import llvm

TRACE_WORDS = 5
"""int64 words per task of a trace: the consumers' SM, the producer's claim, the producer's operands ready (after
its counter wait; 0 for a task without one), the consumers' take from the queue, the consumers' end (after the
task's signal); times are ``%globaltimer`` ns."""
TRACE_SM, TRACE_CLAIM, TRACE_READY, TRACE_TAKE, TRACE_DONE = range(TRACE_WORDS)


def globaltimer():
    """``%globaltimer``: the GPU's ns clock, the same on every SM."""
    asm = llvm.inline_asm(cutlass.Int64.mlir_type, [], "mov.u64 $0, %globaltimer;", "=l", has_side_effects=True)
    return cutlass.Int64(asm)


def smid():
    """``%smid``: the SM this thread runs on."""
    return cutlass.Int64(cutlass.Int32(llvm.inline_asm(cutlass.Int32.mlir_type, [], "mov.u32 $0, %smid;", "=r")))
