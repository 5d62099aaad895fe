"""What a side-by-side run records about its machine (`mtplib.lab.sidebyside`): the load average,
read before and after every run, and the host, pins and upstream build.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from mtplib import paths, pins


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return [float("nan")] * 3


def host_info() -> dict:
    from mtplib.host import cpu_info, git_state
    from mtplib.lab.upstream_tools import tools_dir

    info = {"machine": platform.machine(), "cpus": os.cpu_count(), "python":
            platform.python_version(), "pins": pins.as_dict(),
            "mtplib_git": git_state(paths.REPO),
            "cpu_model": cpu_info()["model"]}
    bi = tools_dir() / "build_info.json"
    if bi.is_file():
        info["upstream_build"] = json.loads(bi.read_text())
    return info
