"""One error base for everything mtplib raises on purpose.

The CLI catches `MtplibError` alone and prints one line; anything else reaching it is a bug
in mtplib and keeps its traceback. Two branches, so callers can tell the user's fault from
upstream's:

- `InputError` (also a `ValueError`): the input is wrong; the message says what to change.
- `UpstreamFault` (also a `RuntimeError`): upstream llama.cpp, a shard, or an external tool
  failed or refused; the message says what was running.
"""

from __future__ import annotations


class MtplibError(Exception):
    """Base of every error mtplib raises deliberately."""


class InputError(MtplibError, ValueError):
    """Bad input: a file, an option, a plan, a lane, a call made in the wrong state."""


class UpstreamFault(MtplibError, RuntimeError):
    """Upstream (llama.cpp, an RPC shard, a built tool) failed or refused."""


class CheckFailed(MtplibError):
    """A check ran and found a fault (the CLI exits 1, not 2)."""


class WouldOverwrite(InputError, FileExistsError):
    """Refused: writing would overwrite a file the user has (nothing was written)."""
