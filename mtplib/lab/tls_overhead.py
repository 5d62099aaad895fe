"""What mutual TLS costs a ranged run: the same generations through TLS and in plaintext.

Two `RangedMTP` sessions on the trained pair (local shards: one pair plain, one pair behind
their TLS gateways; both on the star, where TLS keeps a run), generations interleaved A/B
per prompt and repetition so that drift on
a shared host hits both alike, at each RTT (the relays' emulated WAN, applied after
loading), each generation a typed row (`TlsRun`) until the result is written. Per transport
and RTT: n, median, min and max tokens/s; whether the tokens are
identical; waits per step of each kind (TLS must not add a round trip: the gateway's status
line is read before upstream's client sends a byte).

``python -m mtplib.lab.tls_overhead --out DIR [--rtts 0,100 --reps 3 --n-prompts 4]``
writes DIR/tls_overhead.json and prints the summary. ``--micro`` measures the transport
alone instead (`micro`): the round trip of one small answered request, and the throughput
of a stream of SET_TENSOR requests, through a relay to a plain RPC peer vs a relay speaking
TLS to a gateway in front of it (alternating, many times), which a loaded host disturbs less
than whole generations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from mtplib import host, paths
from mtplib.lab.common.tables import row_from_dict, typed
from mtplib.runtime import build_info
from mtplib.runtime.links import WanLink
from mtplib.runtime.rpc import recv_exact

TRANSPORTS = ("plaintext", "tls")


@dataclass(frozen=True)
class TlsRun:
    """One generation of the TLS comparison: a row of tls_overhead.json's ``rows``. Built
    typed where it is measured (`run`), read typed by `summarize`; a dict (`to_dict`, the
    fields in order) in the file only."""

    transport: str  # one of TRANSPORTS
    rtt_ms: float
    prompt: int
    rep: int
    tokens: list[int]
    decode_tok_s: float | None
    waits_per_step: dict[str, float]
    seam_bytes: int
    transport_metric: str  # the transport the run's metrics report (plain | tls)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, r: dict) -> TlsRun:
        return row_from_dict(cls, r, "a TLS-overhead row")


def run(rtts_ms: list[float], *, reps: int = 3, n_prompts: int = 4, n_new: int = 24,
        prompt_len: int = 48, k: int = 2, placement: str = "client", head: str = "client",
        plan: str = "0-1,2-3", log=print) -> dict:
    from mtplib.distributed.ranged_mtp import RangedMTP
    from mtplib.distributed.tls import TlsConfig, init_pki
    from mtplib.lab.wan.inputs import trained_prompts
    from mtplib.model.trained import trained_paths
    from mtplib.runtime.engine_options import EngineOptions
    from mtplib.runtime.settings import DecodeSettings

    pair = trained_paths()
    prompts = trained_prompts(n_prompts, prompt_len)
    opts = EngineOptions(k=k, settings=DecodeSettings(n_ctx=256, n_threads=1), head=head)
    rows: list[TlsRun] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="mtplib-tls-") as d:
        init_pki(d)
        tls = TlsConfig.load(d)
        # both on the star, so the pair differs by the transport alone (the ring through the
        # gateways is measured apart: tests/test_tls_ring.py)
        with RangedMTP(str(pair.trunk), plan=plan, sidecar=str(pair.sidecar),
                       mtp_placement=placement, seam="star") as plain, \
                RangedMTP(str(pair.trunk), plan=plan, sidecar=str(pair.sidecar),
                          mtp_placement=placement, tls=tls, seam="star") as secure:
            runs = dict(zip(TRANSPORTS, (plain, secure), strict=True))
            for r in runs.values():  # warm-up over loopback, not recorded
                r.generate(list(prompts[0]), n_new, opts)
            for rtt in rtts_ms:
                for r in runs.values():
                    for relay in r.rt.relays.relays:
                        relay.set_link(WanLink(rtt))
                for rep in range(reps):
                    for pi, prompt in enumerate(prompts):
                        order = list(runs) if (rep + pi) % 2 == 0 else list(runs)[::-1]
                        for name in order:
                            toks, m = runs[name].generate(list(prompt), n_new, opts)
                            rows.append(TlsRun(transport=name, rtt_ms=rtt, prompt=pi,
                                               rep=rep, tokens=toks,
                                               decode_tok_s=m.decode_tok_s,
                                               waits_per_step=m.waits_per_step,
                                               seam_bytes=m.seam_bytes,
                                               transport_metric=m.transport))
                log(f"rtt {rtt:g} ms: {summary_line(rows, rtt)}")
    return {"config": {"rtts_ms": rtts_ms, "reps": reps, "n_prompts": n_prompts,
                       "n_new": n_new, "prompt_len": prompt_len, "k": k,
                       "mtp_placement": placement, "head": head, "plan": plan},
            "rows": [r.to_dict() for r in rows], "summary": summarize(rows),
            "wall_s": time.time() - t0}


def _peer():
    """A minimal RPC peer on loopback: answers HELLO and DEVICE_COUNT like a server and
    swallows the rest (one connection at a time)."""
    import socket
    import struct
    import threading

    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = b""
            try:
                while True:
                    while len(buf) < 9:
                        d = c.recv(1 << 20)
                        if not d:
                            raise ConnectionError
                        buf += d
                    cmd, (size,) = buf[0], struct.unpack("<Q", buf[1:9])
                    buf = buf[9:]
                    while len(buf) < size:
                        d = c.recv(1 << 20)
                        if not d:
                            raise ConnectionError
                        buf += d
                    buf = buf[size:]
                    if cmd == 14:
                        c.sendall(struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(24))
                    elif cmd == 15:  # DEVICE_COUNT: one
                        c.sendall(struct.pack("<QI", 4, 1))
            except OSError:
                c.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def micro(rounds: int = 7, n_rtt: int = 300, mib: int = 64, log=print) -> dict:
    """Round trip (HELLO) and SET_TENSOR throughput: relay -> peer vs relay -TLS-> gateway
    -> peer, ``rounds`` alternating rounds of ``n_rtt`` round trips and ``mib`` MiB each."""
    import socket
    import struct

    from mtplib.distributed.gateway import Gateway
    from mtplib.distributed.relay import CountingRelay
    from mtplib.distributed.tls import TlsConfig, init_pki
    from mtplib.runtime.rpc import RPC_CMD_HELLO, RPC_SET_TENSOR, SET_TENSOR_HEADER

    hello = bytes([RPC_CMD_HELLO]) + struct.pack("<Q", 24) + bytes(24)
    payload = bytes(SET_TENSOR_HEADER + (1 << 20))
    tensor = bytes([RPC_SET_TENSOR]) + struct.pack("<Q", len(payload)) + payload
    res: dict = {"plaintext": {"rtt_us": [], "mib_s": []}, "tls": {"rtt_us": [], "mib_s": []}}
    with tempfile.TemporaryDirectory(prefix="mtplib-tls-") as d:
        init_pki(d)
        tls = TlsConfig.load(d)
        srv = _peer()
        peer = f"127.0.0.1:{srv.getsockname()[1]}"
        gw = Gateway(("127.0.0.1", 0), ("127.0.0.1", srv.getsockname()[1]), tls,
                     log=lambda s: None).start()
        relays = {"plaintext": CountingRelay(peer), "tls": CountingRelay(gw.endpoint, tls=tls)}
        try:
            for rnd in range(rounds):
                for name in (("plaintext", "tls") if rnd % 2 == 0 else ("tls", "plaintext")):
                    host, port = relays[name].endpoint.split(":")
                    with socket.create_connection((host, int(port))) as s:
                        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        s.sendall(hello)  # the session's first request
                        recv_exact(s, 36)
                        t = time.perf_counter()
                        for _ in range(n_rtt):
                            s.sendall(bytes([15]) + struct.pack("<Q", 0))
                            recv_exact(s, 12)
                        res[name]["rtt_us"].append((time.perf_counter() - t) / n_rtt * 1e6)
                        t = time.perf_counter()
                        for _ in range(mib):
                            s.sendall(tensor)
                        s.sendall(bytes([15]) + struct.pack("<Q", 0))  # answered: all arrived
                        recv_exact(s, 12)
                        res[name]["mib_s"].append(mib / (time.perf_counter() - t))
                    time.sleep(0.2)  # the gateway closes the session before the next
            log(f"micro: {res}")
        finally:
            for r in relays.values():
                r.close()
            gw.close()
            srv.close()
    out = {"rounds": rounds, "n_rtt": n_rtt, "mib": mib}
    for name, v in res.items():
        out[name] = {k: {"n": len(x), "median": statistics.median(x), "min": min(x),
                         "max": max(x)} for k, x in v.items()}
    return out


def summarize(rows: Sequence[TlsRun | dict]) -> list[dict]:
    """Per RTT: each transport's tok/s (n, median, min, max), whether tokens and waits per
    step are identical pair by pair, the ratio of medians and the paired ratio."""
    out = []
    runs = typed(TlsRun, rows)
    for rtt in sorted({r.rtt_ms for r in runs}):
        at = [r for r in runs if r.rtt_ms == rtt]
        row: dict = {"rtt_ms": rtt}
        for name in TRANSPORTS:
            v = [r.decode_tok_s for r in at if r.transport == name]
            row[name] = {"n": len(v), "median_tok_s": statistics.median(v),
                         "min_tok_s": min(v), "max_tok_s": max(v)}
        pairs: dict[tuple[int, int], dict[str, TlsRun]] = {(r.prompt, r.rep): {} for r in at}
        for r in at:
            pairs[(r.prompt, r.rep)][r.transport] = r
        row["tokens_identical"] = all(p["plaintext"].tokens == p["tls"].tokens
                                      for p in pairs.values())
        row["waits_per_step_identical"] = all(
            p["plaintext"].waits_per_step == p["tls"].waits_per_step for p in pairs.values())
        row["waits_per_step"] = at[0].waits_per_step
        row["tls_over_plaintext"] = row["tls"]["median_tok_s"] / row["plaintext"]["median_tok_s"]
        # the same prompt and repetition, back to back: prompts differ in speed (acceptance),
        # so the paired ratio is the tighter measure of what TLS costs
        ratios = [p["tls"].decode_tok_s / p["plaintext"].decode_tok_s
                  for p in pairs.values()]
        row["paired_ratio"] = {"n": len(ratios), "median": statistics.median(ratios),
                               "min": min(ratios), "max": max(ratios)}
        out.append(row)
    return out


def summary_line(rows: Sequence[TlsRun | dict], rtt: float) -> str:
    s = next(x for x in summarize(rows) if x["rtt_ms"] == rtt)
    p, t = s["plaintext"], s["tls"]
    return (f"plaintext median {p['median_tok_s']:.2f} tok/s [{p['min_tok_s']:.2f}, "
            f"{p['max_tok_s']:.2f}] n={p['n']}; tls {t['median_tok_s']:.2f} "
            f"[{t['min_tok_s']:.2f}, {t['max_tok_s']:.2f}] n={t['n']}; ratio of medians "
            f"{s['tls_over_plaintext']:.3f}; paired ratio median {s['paired_ratio']['median']:.3f}"
            f" [{s['paired_ratio']['min']:.3f}, {s['paired_ratio']['max']:.3f}] "
            f"n={s['paired_ratio']['n']}; tokens identical {s['tokens_identical']}; "
            f"waits per step identical {s['waits_per_step_identical']} {s['waits_per_step']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtplib.lab.tls_overhead",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for tls_overhead.json")
    ap.add_argument("--rtts", default="0,100", help="emulated RTTs in ms, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--n-new", type=int, default=24)
    ap.add_argument("--micro", action="store_true", help="the transport alone (see above)")
    a = ap.parse_args(argv)
    prov = host.provenance(paths.REPO, build_info(), [
        "python -m mtplib.lab.tls_overhead", *(sys.argv[1:] if argv is None else argv)])
    if a.micro:
        res = micro(log=lambda s: None)
        res["provenance"] = host.finish(prov)
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tls_micro.json").write_text(json.dumps(res, indent=1))
        for name in ("plaintext", "tls"):
            r, m = res[name]["rtt_us"], res[name]["mib_s"]
            print(f"{name}: round trip median {r['median']:.0f} us [{r['min']:.0f}, "
                  f"{r['max']:.0f}], SET_TENSOR stream median {m['median']:.0f} MiB/s "
                  f"[{m['min']:.0f}, {m['max']:.0f}], n={r['n']} rounds")
        print(out / "tls_micro.json")
        return 0
    res = run([float(x) for x in a.rtts.split(",")], reps=a.reps, n_prompts=a.n_prompts,
              n_new=a.n_new)
    res["provenance"] = host.finish(prov)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tls_overhead.json").write_text(json.dumps(res, indent=1))
    for row in res["summary"]:
        print(f"rtt {row['rtt_ms']:g} ms: {summary_line(res['rows'], row['rtt_ms'])}")
    print(out / "tls_overhead.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
