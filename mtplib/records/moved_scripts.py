"""The evidence scripts that became `mtplib.reports` modules (issue 42), and a recorded
command run again through its module.

A results file keeps the command that made it, as it ran (``evidence/serve/measure.py
--prompts 16 ...``): that is what happened, so it is not rewritten. Its run entry
(`mtplib.records.evidence_runs`) adds ``rerun``: the same arguments through the module the
script is now (``python -m mtplib.reports.serve.measure --prompts 16 ...``).
"""

from __future__ import annotations

#: the script's path in the repository (as it was) -> the module it is now
MOVED_SCRIPTS: dict[str, str] = {
    "evidence/dspark-shards/measure.py": "mtplib.reports.dspark_shards.measure",
    "evidence/graph-reuse/bytes_table.py": "mtplib.reports.graph_reuse.bytes_table",
    "evidence/graph-reuse/pipeline_ttft.py": "mtplib.reports.graph_reuse.pipeline_ttft",
    "evidence/graph-reuse/shared_cores.py": "mtplib.reports.graph_reuse.shared_cores",
    "evidence/graph-reuse/wan_cells.py": "mtplib.reports.graph_reuse.wan_cells",
    "evidence/placement/placement_table.py": "mtplib.reports.placement.placement_table",
    "evidence/serve/batch_bench.py": "mtplib.reports.serve.batch_bench",
    "evidence/serve/batch_steps.py": "mtplib.reports.serve.batch_steps",
    "evidence/serve/measure.py": "mtplib.reports.serve.measure",
    "evidence/serve/reconnect_time.py": "mtplib.reports.serve.reconnect_time",
    "evidence/serve/serve_steplog.py": "mtplib.reports.serve.serve_steplog",
    "evidence/serve/structured.py": "mtplib.reports.serve.structured",
    "evidence/side-by-side/profile/c_decode.py": "mtplib.reports.side_by_side.c_decode",
    "evidence/side-by-side/profile/loop_ab.py": "mtplib.reports.side_by_side.loop_ab",
    "evidence/side-by-side/profile/overhead.py": "mtplib.reports.side_by_side.overhead",
    "evidence/ttft/setup_queries.py": "mtplib.reports.ttft.setup_queries",
    "evidence/ttft/ttft.py": "mtplib.reports.ttft.ttft",
    "evidence/upstream-bugs/decode_lengths.py": "mtplib.reports.upstream_bugs.decode_lengths",
    "evidence/upstream-bugs/mtp_context_rows.py":
        "mtplib.reports.upstream_bugs.mtp_context_rows",
    "evidence/upstream-bugs/overlap_probe.py": "mtplib.reports.upstream_bugs.overlap_probe",
    "evidence/upstream-bugs/repro_crashes.py": "mtplib.reports.upstream_bugs.repro_crashes",
    "evidence/upstream-bugs/repro_hidden_rows.py":
        "mtplib.reports.upstream_bugs.repro_hidden_rows",
    "evidence/upstream-bugs/repro_rollback_crossing.py":
        "mtplib.reports.upstream_bugs.repro_rollback_crossing",
    "evidence/upstream-bugs/repro_state_crossing.py":
        "mtplib.reports.upstream_bugs.repro_state_crossing",
    "evidence/upstream-patches/report.py": "mtplib.reports.upstream_patches.report",
    "evidence/upstream-patches/ring_kinds.py": "mtplib.reports.upstream_patches.ring_kinds",
    "evidence/upstream-patches/ring_projection.py":
        "mtplib.reports.upstream_patches.ring_projection",
    "evidence/upstream-patches/ring_rtt.py": "mtplib.reports.upstream_patches.ring_rtt",
    "evidence/upstream-patches/ring_tokens.py": "mtplib.reports.upstream_patches.ring_tokens",
    "evidence/upstream-patches/ring_waits.py": "mtplib.reports.upstream_patches.ring_waits",
    "evidence/upstream-patches/rpc_llama_split.py":
        "mtplib.reports.upstream_patches.rpc_llama_split",
    "evidence/upstream-patches/seam_waits.py": "mtplib.reports.upstream_patches.seam_waits",
    "evidence/upstream-patches/step_profile.py": "mtplib.reports.upstream_patches.step_profile",
    "evidence/upstream-patches/windows_projection.py":
        "mtplib.reports.upstream_patches.windows_projection",
    "evidence/wan/projection_report.py": "mtplib.reports.wan.projection",
    "evidence/wan/target/headline.py": "mtplib.reports.wan.target_headline",
    "evidence/wan/waits_by_step.py": "mtplib.reports.wan.waits_by_step",
}


def rerun(command: str, folder: str) -> str | None:
    """``command`` as a results file in ``folder`` (``evidence/<topic>``) recorded it, run
    through the module its script became: ``python -m MODULE`` and the same arguments; None
    where it names no moved script. Older files recorded the script's name alone
    (``bytes_table.py --builds ...``): that name is the folder's."""
    words = command.split()
    for i, w in enumerate(words):
        if not w.endswith(".py"):
            continue
        module = MOVED_SCRIPTS.get(w if "/" in w else f"{folder}/{w}")
        if module is not None:
            return " ".join(["python", "-m", module, *words[i + 1:]])
    return None
