"""How the tests' torch.distributed rank scripts end: together, and without Python's finalization.

Caught under gdb in a 2-rank gloo run (tests/python/sharded, about 1 run in 25 on the 2-core
VM): after `barrier()` and `destroy_process_group()` the main thread entered Py_FinalizeEx while
gloo's `pt_gloo_runloop` thread was still dropping the barrier's work, which holds the earlier
all-gathers (DTensor `full_tensor`, FSDP2); their tensors have Python objects, the decref wants
the GIL, a finalizing interpreter ends the thread with a forced unwind, and the process aborts:
"terminate called without an active exception". destroy_process_group does not wait for those
threads. A rank that has done its work and left the group therefore exits with os._exit: the
deltasync objects it made are closed by then (publish returns after the commit)."""
from __future__ import annotations

import os
import sys

import torch.distributed as dist


def leave(code: int = 0) -> None:
    """Every rank leaves the group together, then the process exits with `code`."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
