"""The C library calls mtplib makes besides llama.cpp's: kept in the ctypes room.

Python's standard library has no ``prctl``; the shard and worker processes need
PR_SET_PDEATHSIG so that they die with the process that started them.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits (Linux
    prctl). False where that is not available (another OS, no libc): the caller's
    watchdog is then the only safeguard."""
    with contextlib.suppress(Exception):
        return int(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig),
                                                            0, 0, 0)) == 0
    return False
