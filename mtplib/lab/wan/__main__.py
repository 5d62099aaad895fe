"""``python -m mtplib.lab.wan``: the WAN benchmark on the trained pair (`measure.main`). A
refused config or folder exits 2 with its one line, not a traceback."""

from __future__ import annotations

import logging

from mtplib import logs
from mtplib.errors import InputError
from mtplib.lab.wan.measure import main

log = logging.getLogger(__name__)

if __name__ == "__main__":
    logs.configure()
    try:
        raise SystemExit(main())
    except InputError as e:
        log.error("python -m mtplib.lab.wan: error: %s", e)
        raise SystemExit(2) from None
