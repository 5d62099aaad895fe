"""Upstream's own C++ tools, built from the pinned sdist, for side-by-side runs.

Opt-in (never part of CI): `build_tools()` compiles `llama-server` (and `llama-cli`, both
on upstream's server loop in tools/server/server-context.cpp) from the pinned
llama-cpp-python sdist's `vendor/llama.cpp` once, CPU only, with the flags the Python
wheel is built with (Release, GGML_NATIVE on, GGML_RPC on), and caches the binaries under
``$MTPLIB_CACHE_DIR/upstream-tools/<commit>/bin`` (default ~/.cache/mtplib; the issue
estimates about 9 minutes on 2 idle cores; 28 minutes were measured here under a load of
about 5).

Why llama-server: at the pinned commit `--spec-synth-rates` is accepted by the server and
the CLI only (common/arg.cpp: LLAMA_EXAMPLE_SERVER, LLAMA_EXAMPLE_CLI), and llama-cli runs
the same server loop in a thread behind a chat template. The server's ``/completion``
endpoint takes the prompt as token ids, so upstream and mtplib decode exactly the same
prompt. The V4 MTP sidecar is passed as a draft model: ``--spec-type draft-mtp -md
mtp-X.gguf`` (common/speculative.cpp common_speculative_init_result: with a draft model
path the MTP context is created over that file, loaded with load_mtp; without -md it is
created over the target model itself).

Timing parity: the server's ``timings.predicted_per_second`` is (n_gen - 1) / (time of
the last token - time of the first token) (tools/server/server-common.h
server_slot_stats), the same definition as mtplib's ``decode_tok_s``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mtplib import envs, pins
from mtplib.errors import UpstreamFault
from mtplib.runtime import OMP_DEFAULTS
from mtplib.runtime.settings import DecodeSettings

TARGETS = ("llama-server", "llama-cli")
SDIST_NAME = f"llama_cpp_python-{pins.LLAMA_CPP_PYTHON_VERSION}.tar.gz"


def sdist_candidates() -> tuple[Path, ...]:
    """Where the pinned sdist may already be: /tmp/sdist, then the cache ($MTPLIB_CACHE_DIR,
    where ./dev.sh setup keeps it)."""
    return (Path("/tmp/sdist") / SDIST_NAME, envs.cache_dir() / "sdist" / SDIST_NAME)

#: CPU build, the wheel's flags (GGML_NATIVE defaults on, GGML_RPC from pins.CMAKE_ARGS),
#: static libraries so the binaries never pick up another libllama; no web UI download,
#: no OpenSSL, no tests or examples.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_RPC=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
#: Flags the side-by-side needs; `check_flags` looks for each in `llama-server --help`.
REQUIRED_FLAGS = ("--spec-type", "--spec-draft-n-max", "--spec-synth-rates", "--spec-draft-model")


class UpstreamToolError(UpstreamFault):
    """Upstream's tools are missing, failed to build, or a run failed."""


def tools_dir(commit: str = pins.LLAMA_CPP_COMMIT) -> Path:
    return envs.cache_dir() / "upstream-tools" / commit


def find_sdist(sdist: str | Path | None = None) -> Path:
    """The pinned sdist: ``sdist`` if given, else a known location, else `pip download`."""
    if sdist:
        p = Path(sdist)
        if not p.is_file():
            raise UpstreamToolError(f"sdist {p} not found")
        return p
    for p in sdist_candidates():
        if p.is_file():
            return p
    dest = envs.cache_dir() / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    cmd = ["pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dest),
           f"llama-cpp-python=={pins.LLAMA_CPP_PYTHON_VERSION}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    p = dest / SDIST_NAME
    if r.returncode or not p.is_file():
        raise UpstreamToolError(f"could not get the sdist ({' '.join(cmd)}): {r.stderr[-500:]}")
    return p


def tool_path(name: str, commit: str = pins.LLAMA_CPP_COMMIT) -> Path:
    return tools_dir(commit) / "bin" / name


def have_tools(commit: str = pins.LLAMA_CPP_COMMIT) -> bool:
    return all(tool_path(t, commit).is_file() for t in TARGETS)


def build_tools(*, sdist: str | Path | None = None, jobs: int = 2, force: bool = False,
                log=print) -> Path:
    """Build upstream's tools once (cached); returns the bin directory."""
    root = tools_dir()
    bindir = root / "bin"
    if have_tools() and not force:
        return bindir
    src = root / "src"
    if force or not (src / "CMakeLists.txt").is_file():
        sd = find_sdist(sdist)
        log(f"unpacking {sd}")
        shutil.rmtree(src, ignore_errors=True)
        tmp = root / "unpack"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with tarfile.open(sd) as tf:
            prefix = f"llama_cpp_python-{pins.LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
            members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
            tf.extractall(tmp, members=members, filter="data")
        (tmp / prefix).rename(src)
        shutil.rmtree(tmp, ignore_errors=True)
    build = root / "build"
    t0 = time.time()
    cfg = ["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS,
           f"-DLLAMA_BUILD_COMMIT={pins.LLAMA_CPP_COMMIT_SHORT}"]
    log(" ".join(cfg))
    _run_logged(cfg, root / "cmake-configure.log")
    bld = ["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(jobs)]
    log(" ".join(bld) + "  (about 9 minutes on 2 cores)")
    _run_logged(bld, root / "cmake-build.log")
    bindir.mkdir(parents=True, exist_ok=True)
    for t in TARGETS:
        found = list((build / "bin").glob(t)) or list(build.rglob(t))
        if not found:
            raise UpstreamToolError(f"{t} was not produced; see {root / 'cmake-build.log'}")
        shutil.copy2(found[0], bindir / t)
    info = {"commit": pins.LLAMA_CPP_COMMIT, "cmake_flags": list(CMAKE_FLAGS),
            "targets": list(TARGETS), "build_s": round(time.time() - t0, 1),
            "flags_checked": check_flags(bindir / "llama-server")}
    (root / "build_info.json").write_text(json.dumps(info, indent=2))
    log(f"built {', '.join(TARGETS)} in {info['build_s']} s -> {bindir}")
    return bindir


def _run_logged(cmd: Sequence[str], log_path: Path) -> None:
    with open(log_path, "w") as f:
        r = subprocess.run(list(cmd), stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        tail = log_path.read_text()[-2000:]
        raise UpstreamToolError(f"{cmd[0]} failed (rc {r.returncode}); {log_path}:\n{tail}")


def check_flags(binary: Path, flags: Sequence[str] = REQUIRED_FLAGS) -> dict[str, bool]:
    """Which of ``flags`` the binary's --help lists (it must list them all)."""
    r = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    text = r.stdout + r.stderr
    got = {f: bool(re.search(re.escape(f) + r"\b", text)) for f in flags}
    missing = [f for f, ok in got.items() if not ok]
    if missing:
        raise UpstreamToolError(f"{binary.name} at this commit lacks {missing}")
    return got


# -- running llama-server ----------------------------------------------------------------
#: llama-server's own defaults for what DecodeSettings holds (swa_full: false, a
#: window-sized SWA cache; --swa-full turns it on)
SERVER_SETTINGS = DecodeSettings(swa_full=False)


@dataclass
class ServerConfig:
    """One llama-server process: a trunk, optionally the MTP sidecar, and the same
    DecodeSettings as mtplib's side (threads, n_ctx, batch, KV type, flash attention, SWA
    cache; hidden_rows has no upstream counterpart)."""

    model: str
    mtp: str | None = None
    k: int = 0
    rates: Sequence[float] | None = None
    settings: DecodeSettings = SERVER_SETTINGS
    seed: int = 0
    extra: list[str] = field(default_factory=list)

    def argv(self, binary: Path, port: int) -> list[str]:
        s = self.settings
        a = [str(binary), "-m", self.model, "--host", "127.0.0.1", "--port", str(port),
             "-t", str(s.n_threads), "-tb", str(s.n_threads), "-c", str(s.n_ctx),
             "-b", str(s.n_batch), "-ub", str(s.n_ubatch), "-np", "1",
             "-ctk", s.kv_type, "-ctv", s.kv_type, "-fa", s.flash_attn,
             "--no-warmup", "--seed", str(self.seed)]
        if s.swa_full:
            a.append("--swa-full")
        a += spec_args(self.mtp, self.k, self.rates)
        return a + list(self.extra)


def spec_args(mtp: str | None, k: int, rates: Sequence[float] | None) -> list[str]:
    """Upstream's MTP flags: the sidecar as the draft model of type draft-mtp."""
    if not mtp or k <= 0:
        if rates:
            raise UpstreamToolError("synthetic rates need MTP (a sidecar and k > 0)")
        return []
    a = ["--spec-type", "draft-mtp", "-md", mtp, "--spec-draft-n-max", str(k)]
    if rates is not None:
        rates = list(rates)
        if len(rates) != k:  # upstream: "must contain n_max values"
            raise UpstreamToolError(f"--spec-synth-rates needs {k} values, got {len(rates)}")
        a += ["--spec-synth-rates", format_rates(rates)]
    return a


def format_rates(rates: Sequence[float]) -> str:
    return ",".join(f"{float(r):g}" for r in rates)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A llama-server on loopback for one configuration; `complete()` runs one request."""

    def __init__(self, cfg: ServerConfig, *, binary: Path | None = None,
                 log_path: Path | None = None, start_timeout: float = 300.0) -> None:
        self.cfg = cfg
        self.binary = binary or tool_path("llama-server")
        if not self.binary.is_file():
            raise UpstreamToolError(f"{self.binary} missing: run `mtplib compare-upstream "
                                    "--build-only` first")
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        # upstream's threads wait as mtplib's do (OMP_DEFAULTS; a value set here wins)
        self.proc = subprocess.Popen(cfg.argv(self.binary, self.port), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**OMP_DEFAULTS, **os.environ})
        self._wait_ready(start_timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> None:
        t_end = time.time() + timeout
        while time.time() < t_end:
            if self.proc.poll() is not None:
                raise UpstreamToolError(f"llama-server exited with {self.proc.returncode}; "
                                        f"log: {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.close()
        raise UpstreamToolError(f"llama-server not ready after {timeout} s; log: {self.log_path}")

    def complete(self, prompt: Sequence[int], n_new: int, *, timeout: float = 600.0) -> dict:
        """One greedy completion of ``prompt`` (token ids), no prompt cache reuse."""
        body = completion_body(prompt, n_new, seed=self.cfg.seed)
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def completion_body(prompt: Sequence[int], n_new: int, *, seed: int = 0) -> dict:
    """The /completion request: token-id prompt, exactly n_new greedy tokens, fresh cache."""
    return {"prompt": [int(t) for t in prompt], "n_predict": int(n_new), "temperature": 0.0,
            "top_k": 1, "seed": int(seed), "cache_prompt": False, "ignore_eos": True,
            "return_tokens": True, "stream": False}


@dataclass(frozen=True)
class Completion:
    """The numbers of one /completion response (`parse_completion`): what the side-by-side
    records of an upstream run, before the case it ran in is added (`sidebyside.SideRun`)."""

    decode_tok_s: float
    n_generated: int
    decode_ms: float
    prompt_n: int
    prompt_tok_s: float
    drafted: int
    accepted: int
    acceptance_rate: float | None
    tokens: list[int]


def parse_completion(resp: dict) -> Completion:
    """The numbers of one /completion response: decode tok/s, counts, tokens."""
    t = resp.get("timings") or {}
    if "predicted_per_second" not in t:
        raise UpstreamToolError(f"no timings in the server response: {sorted(resp)}")
    drafted = t.get("draft_n")
    accepted = t.get("draft_n_accepted")
    return Completion(decode_tok_s=float(t["predicted_per_second"]),
                      n_generated=int(t.get("predicted_n", 0)),
                      decode_ms=float(t.get("predicted_ms", 0.0)),
                      prompt_n=int(t.get("prompt_n", 0)),
                      prompt_tok_s=float(t.get("prompt_per_second", 0.0)),
                      drafted=int(drafted) if drafted is not None else 0,
                      accepted=int(accepted) if accepted is not None else 0,
                      acceptance_rate=(accepted / drafted) if drafted else None,
                      tokens=list(resp.get("tokens") or []))


@dataclass(frozen=True)
class CliTimings:
    """llama-cli's closing line: prompt and generation tok/s."""

    prompt_tok_s: float
    decode_tok_s: float


@dataclass(frozen=True)
class LoggedTiming:
    """One request's print_timings block of llama-server's log; the draft counts are None
    where the block has no "draft acceptance" line (MTP off)."""

    decode_ms: float
    n_generated: int
    ms_per_token: float
    decode_tok_s: float
    acceptance_rate: float | None = None
    accepted: int | None = None
    drafted: int | None = None


#: `llama-cli` / server log line: "[ Prompt: 123.4 t/s | Generation: 56.7 t/s ]"
_CLI_RE = re.compile(r"\[\s*Prompt:\s*([0-9.]+)\s*t/s\s*\|\s*Generation:\s*([0-9.]+)\s*t/s\s*\]")
#: llama-server's print_timings lines (tools/server/server-context.cpp), e.g.
#: "... | task 0 |        eval time =   40951.70 ms /    64 tokens (  650.03 ms per token,
#: 1.54 tokens per second)" and "... | task 0 | draft acceptance = 0.56897 (   33 accepted /
#: 58 generated), mean len =  2.14". "per token" divides by n - 1 decode steps.
_EVAL_RE = re.compile(r"\|\s+eval time\s*=\s*([0-9.]+) ms\s*/\s*(\d+) tokens\s*\(\s*([0-9.]+) ms "
                      r"per token,\s*([0-9.]+) tokens per second\)")
_DRAFT_RE = re.compile(r"draft acceptance\s*=\s*([0-9.]+)\s*\(\s*(\d+) accepted\s*/\s*(\d+) "
                       r"generated\)")


def parse_cli_timings(text: str) -> CliTimings | None:
    """Prompt / generation tok/s from llama-cli's closing line (last one wins)."""
    m = _CLI_RE.findall(text)
    if not m:
        return None
    p, g = m[-1]
    return CliTimings(prompt_tok_s=float(p), decode_tok_s=float(g))


def parse_server_log(text: str) -> list[LoggedTiming]:
    """The per-request timing blocks llama-server logs (print_timings), in order."""
    evals = _EVAL_RE.findall(text)
    drafts = [dict(acceptance_rate=float(rate), accepted=int(acc), drafted=int(gen))
              for rate, acc, gen in _DRAFT_RE.findall(text)]
    drafts += [{}] * (len(evals) - len(drafts))
    return [LoggedTiming(decode_ms=float(ms), n_generated=int(n), ms_per_token=float(per),
                         decode_tok_s=float(tps), **d)
            for (ms, n, per, tps), d in zip(evals, drafts, strict=False)]
