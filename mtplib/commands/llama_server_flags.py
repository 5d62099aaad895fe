"""Every option llama-server takes (common/arg.cpp at the pin: the server's own and the
common ones) and what `mtplib serve` does with it.

Why a table: a copied `llama-server -m X --jinja -np 4 --metrics` line must serve, not stop
at the first flag argparse does not know. Each option either works (the serve parser has
it under llama-server's spelling), is accepted with one logged line saying why it changes
nothing here, or is refused in one line naming mtplib's equivalent. The kind written here
is the fallback: an option the serve parser has (another verb's options added to
`generate.add_engine_args` reach serve too) works, whatever this table says
(`llama_server_args.classify`). tests/test_llama_server_flags.py checks the spellings
against the pinned arg.cpp; docs/cli.md carries the table `llama_server_args` renders.
"""

from __future__ import annotations

from dataclasses import dataclass

WORKS, NOOP, REFUSED = "works", "no-op", "refused"


@dataclass(frozen=True)
class ServerFlag:
    """One llama-server option: its spellings, its value (None: a bare flag), what mtplib
    serve does with it (`WORKS`, `NOOP`, `REFUSED`) and why: for WORKS the mtplib setting
    it is, for NOOP why it changes nothing, for REFUSED mtplib's equivalent."""

    spellings: tuple[str, ...]
    value: str | None
    kind: str
    why: str


def _f(spellings: str, value: str | None, kind: str, why: str) -> ServerFlag:
    return ServerFlag(tuple(spellings.split()), value, kind, why)


NO_SHIFT = ("mtplib never shifts the context: a generation stops at its end (finish_reason "
            "length), as llama-server's --no-context-shift")
CPU = ("mtplib sets no CPU affinity, priority or polling: run it under taskset or numactl "
       "(affinity) and nice or chrt (priority)")
NGRAM = ("mtplib drafts with a draft model file only (-md/--mtp: the model's MTP block or a "
         "DSpark draft): no n-gram or lookup drafting")
NO_DOWNLOAD = ("mtplib downloads no models: fetch the GGUF and give -m/--model PATH (and "
               "-md/--mtp SIDECAR)")
NO_EMBED = "mtplib serves completions only: no embeddings, reranking or pooling"
TEXT_ONLY = "mtplib serves text only: no multimodal projector"
NO_MEDIA = "mtplib serves text only: no projector or media to configure"
PLACEMENT = ("mtplib has no tensor or device placement setting: the whole model loads on "
             "upstream's default placement, a ranged one where --plan puts it (a shard "
             "serves a GPU with `mtplib shard serve --device gpu`)")
SPLIT = ("mtplib splits a model across devices only as shards: --plan RANGES with one "
         "`mtplib shard serve` per range")
ROPE = "mtplib uses the GGUF's RoPE and YaRN settings as written (no override)"
NO_LORA = "LoRA adapters and control vectors are not implemented in mtplib"
NO_UI = "mtplib serves no web UI, only the API"
NO_TOOLS = ("tools, agents and MCP are not implemented in mtplib (requests with tools are "
            "refused too)")
NO_TOOLS_OFF = "tools and agents are not implemented in mtplib: off is its only mode"
ROUTER = ("mtplib serves one model per process (-m/--model): start one `mtplib serve` per "
          "model")
ROUTER_ONLY = "a router-mode setting: mtplib serves the one -m/--model"
REASONING = ("mtplib passes no reasoning switch to the chat template and parses no "
             "reasoning (requests' reasoning_effort is refused too)")
LOG_FORMAT = "mtplib's log lines have one plain format"
GRAMMAR = ("no server-wide grammar: each request gives its own (grammar, json_schema or "
           "response_format, as llama-server's requests do)")
PRESET = "a llama.cpp preset that downloads a model: give -m/--model PATH"
CORS = ("mtplib answers CORS for any origin (a preflight: 200, its methods and the "
        "headers the page asks for) and no credentials: put a proxy in front to restrict it")
DRAFT_OWN = "mtplib's drafter (-md/--mtp) runs with the trunk's settings"


def _no_cache(what: str = "") -> str:
    return (f"mtplib keeps no prompt cache{what}: every prompt is evaluated in full (the "
            "output is the same)")


def _request(field: str) -> str:
    return (f"the launch line sets only the defaults of -n, --temp, --top-p and --seed: give "
            f"{field} in each request (the service honours it)")


def _sampler(name: str) -> str:
    return f"{name} sampling is not implemented in mtplib (requests are refused it too)"


#: llama-server's options in arg.cpp's order (negations apart where they differ)
FLAGS: tuple[ServerFlag, ...] = (
    _f("-h --help --usage", None, WORKS, "prints mtplib serve's help"),
    _f("--version", None, REFUSED, "run `mtplib --version` (mtplib's version and the pinned "
       "llama.cpp)"),
    _f("-cl --cache-list", None, REFUSED, NO_DOWNLOAD),
    _f("--completion-bash", None, REFUSED, "mtplib prints no shell completion script"),
    _f("-t --threads", "N", WORKS, "--threads"),
    _f("-tb --threads-batch", "N", WORKS, "-tb (only the --threads value: one count for "
       "prompt and generation)"),
    _f("-C --cpu-mask", "M", REFUSED, CPU),
    _f("-Cr --cpu-range", "LO-HI", REFUSED, CPU),
    _f("--cpu-strict", "0|1", REFUSED, CPU),
    _f("--prio", "N", REFUSED, CPU),
    _f("--poll", "N", REFUSED, CPU),
    _f("-Cb --cpu-mask-batch", "M", REFUSED, CPU),
    _f("-Crb --cpu-range-batch", "LO-HI", REFUSED, CPU),
    _f("--cpu-strict-batch", "0|1", REFUSED, CPU),
    _f("--prio-batch", "N", REFUSED, CPU),
    _f("--poll-batch", "0|1", REFUSED, CPU),
    _f("-lcs --lookup-cache-static", "FILE", REFUSED, NGRAM),
    _f("-lcd --lookup-cache-dynamic", "FILE", REFUSED, NGRAM),
    _f("-c --ctx-size", "N", WORKS, "--ctx"),
    _f("--kv-unified-per-slot", "N", REFUSED, "mtplib gives each of -np N slots --ctx / N "
       "positions: give -c N times the positions a slot needs"),
    _f("-n --predict --n-predict", "N", WORKS, "--n (a request's default max_tokens)"),
    _f("-b --batch-size", "N", WORKS, "--batch"),
    _f("-ub --ubatch-size", "N", WORKS, "--ubatch"),
    _f("--keep", "N", NOOP, "mtplib never shifts the context, so it keeps no tokens "
       "through a shift: a generation stops at the context's end (finish_reason length)"),
    _f("--swa-full", None, WORKS, "--swa-full (bare: on)"),
    _f("-ctxcp --ctx-checkpoints --swa-checkpoints", "N", NOOP, _no_cache(" to checkpoint")),
    _f("-cms --checkpoint-min-step", "N", NOOP, _no_cache(" to checkpoint")),
    _f("-cram --cache-ram", "N", NOOP, _no_cache(" to size")),
    _f("-kvu --kv-unified", None, NOOP, "mtplib does not unify the slots' cache: each of "
       "-np N slots holds --ctx / N positions (llama-server's --no-kv-unified), the output "
       "is the same"),
    _f("-no-kvu --no-kv-unified", None, NOOP, "what mtplib does: each of -np N slots holds "
       "--ctx / N positions"),
    _f("--cache-idle-slots --no-cache-idle-slots", None, NOOP, _no_cache()),
    _f("--context-shift --no-context-shift", None, NOOP, NO_SHIFT),
    _f("-fa --flash-attn", "on|off|auto", WORKS, "--flash-attn"),
    _f("--perf --no-perf", None, NOOP, "mtplib times every request itself (timings in each "
       "response); upstream's perf counters are not printed"),
    _f("-e --escape --no-escape", None, NOOP, "escapes apply to prompts given on the "
       "command line: the service takes its prompts in requests"),
    _f("-r --reverse-prompt", "PROMPT", REFUSED, _request("stop")),
    _f("-sp --special", None, REFUSED, "mtplib's text leaves special tokens out, as "
       "llama-server without -sp (return_tokens: true gives the token ids)"),
    _f("--warmup --no-warmup", None, NOOP, "mtplib runs every step shape once at load, "
       "before it listens (the output is the same)"),
    _f("--spm-infill", None, NOOP, "an /infill prompt layout: mtplib serves no /infill"),
    _f("--samplers", "SAMPLERS", REFUSED, "mtplib's sampler order is fixed: penalties, "
       "temperature, top_k, top_p, min_p"),
    _f("--sampler-seq --sampling-seq", "SEQUENCE", REFUSED, "mtplib's sampler order is "
       "fixed: penalties, temperature, top_k, top_p, min_p"),
    _f("-s --seed", "SEED", WORKS, "--seed"),
    _f("--ignore-eos", None, REFUSED, _request("ignore_eos: true")),
    _f("--temp --temperature", "N", WORKS, "--temp"),
    _f("--top-k", "N", REFUSED, _request("top_k")),
    _f("--top-p", "N", WORKS, "--top-p"),
    _f("--min-p", "N", REFUSED, _request("min_p")),
    _f("--top-nsigma --top-n-sigma", "N", REFUSED, _sampler("top-n-sigma")),
    _f("--xtc-probability", "N", REFUSED, _sampler("XTC")),
    _f("--xtc-threshold", "N", REFUSED, _sampler("XTC")),
    _f("--typical --typical-p", "N", REFUSED, _sampler("locally typical")),
    _f("--repeat-last-n", "N", REFUSED, _request("repeat_last_n")),
    _f("--repeat-penalty", "N", REFUSED, _request("repeat_penalty")),
    _f("--presence-penalty", "N", REFUSED, _request("presence_penalty")),
    _f("--frequency-penalty", "N", REFUSED, _request("frequency_penalty")),
    _f("--dry-multiplier", "N", REFUSED, _sampler("DRY")),
    _f("--dry-base", "N", REFUSED, _sampler("DRY")),
    _f("--dry-allowed-length", "N", REFUSED, _sampler("DRY")),
    _f("--dry-penalty-last-n", "N", REFUSED, _sampler("DRY")),
    _f("--dry-sequence-breaker", "STRING", REFUSED, _sampler("DRY")),
    _f("--adaptive-target", "N", REFUSED, _sampler("adaptive-p")),
    _f("--adaptive-decay", "N", REFUSED, _sampler("adaptive-p")),
    _f("--dynatemp-range", "N", REFUSED, _sampler("dynamic temperature")),
    _f("--dynatemp-exp", "N", REFUSED, _sampler("dynamic temperature")),
    _f("--mirostat", "N", REFUSED, _sampler("mirostat")),
    _f("--mirostat-lr", "N", REFUSED, _sampler("mirostat")),
    _f("--mirostat-ent", "N", REFUSED, _sampler("mirostat")),
    _f("-l --logit-bias", "TOKEN_ID(+/-)BIAS", REFUSED, _request("logit_bias")),
    _f("--grammar", "GRAMMAR", REFUSED, GRAMMAR),
    _f("--grammar-file", "FILE", REFUSED, GRAMMAR),
    _f("-j --json-schema", "SCHEMA", REFUSED, GRAMMAR),
    _f("-jf --json-schema-file", "FILE", REFUSED, GRAMMAR),
    _f("-bs --backend-sampling", None, NOOP, "mtplib samples on the host from each verify "
       "step's logits (the output is the same)"),
    _f("--pooling", "TYPE", REFUSED, NO_EMBED),
    _f("--rope-scaling", "TYPE", REFUSED, ROPE),
    _f("--rope-scale", "N", REFUSED, ROPE),
    _f("--rope-freq-base", "N", REFUSED, ROPE),
    _f("--rope-freq-scale", "N", REFUSED, ROPE),
    _f("--yarn-orig-ctx", "N", REFUSED, ROPE),
    _f("--yarn-ext-factor", "N", REFUSED, ROPE),
    _f("--yarn-attn-factor", "N", REFUSED, ROPE),
    _f("--yarn-beta-slow", "N", REFUSED, ROPE),
    _f("--yarn-beta-fast", "N", REFUSED, ROPE),
    _f("-kvo --kv-offload", None, NOOP, "upstream's default, which mtplib keeps: the KV "
       "cache goes with its layers"),
    _f("-nkvo --no-kv-offload", None, REFUSED, "mtplib keeps upstream's default KV "
       "placement (with its layers): no setting keeps it on the host"),
    _f("--repack -nr --no-repack", None, REFUSED, "mtplib decides weight repacking "
       "(upstream's extra CPU buffer types) per host: off only where it aborts (AMX "
       "hosts), on elsewhere; MTPLIB_EXTRA_BUFTS=1 forces it on"),
    _f("--no-host", None, REFUSED, "mtplib keeps upstream's host buffers: no setting "
       "bypasses them"),
    _f("-ctk --cache-type-k", "TYPE", WORKS, "--kv-type (-ctk and -ctv must agree)"),
    _f("-ctv --cache-type-v", "TYPE", WORKS, "--kv-type (-ctk and -ctv must agree)"),
    _f("-dt --defrag-thold", "N", NOOP, "deprecated in llama.cpp itself: it changes "
       "nothing there either"),
    _f("-np --parallel", "N", WORKS, "--parallel (N slots batched continuously)"),
    _f("-cb --cont-batching -nocb --no-cont-batching", None, NOOP, "with -np N (N > 1) "
       "mtplib always batches the slots continuously, with one slot there is nothing to "
       "batch (a request's output is the same either way)"),
    _f("-mm --mmproj", "FILE", REFUSED, TEXT_ONLY),
    _f("-mmu --mmproj-url", "URL", REFUSED, TEXT_ONLY),
    _f("--mmproj-auto --no-mmproj --no-mmproj-auto", None, NOOP, NO_MEDIA),
    _f("--mmproj-offload --no-mmproj-offload", None, NOOP, NO_MEDIA),
    _f("-mmdev --mmproj-device", "DEVICE", NOOP, NO_MEDIA),
    _f("--image-min-tokens", "N", NOOP, NO_MEDIA),
    _f("--image-max-tokens", "N", NOOP, NO_MEDIA),
    _f("--mtmd-batch-max-tokens", "N", NOOP, NO_MEDIA),
    _f("--video-fps", "N", NOOP, NO_MEDIA),
    _f("--video-timestamp-interval", "N", NOOP, NO_MEDIA),
    _f("--video-ffmpeg-dir", "DIR", NOOP, NO_MEDIA),
    _f("--rpc", "SERVERS", WORKS, "--endpoints (with --plan)"),
    _f("-lm --load-mode", "MODE", REFUSED, "mtplib loads the model with upstream's default "
       "(memory-mapped): no setting changes it"),
    _f("-lzm --lazy-mode", "MODE", REFUSED, "mtplib loads the model with upstream's "
       "default: no setting changes it"),
    _f("--numa", "TYPE", REFUSED, "mtplib sets no NUMA policy: run it under numactl"),
    _f("-dev --device", "DEVICES", REFUSED, PLACEMENT),
    _f("--list-devices", None, REFUSED, "`mtplib info` prints the loaded build's system "
       "info"),
    _f("-ot --override-tensor", "PATTERN=TYPE,...", REFUSED, PLACEMENT),
    _f("-cmoe --cpu-moe", None, REFUSED, PLACEMENT),
    _f("-ncmoe --n-cpu-moe", "N", REFUSED, PLACEMENT),
    _f("-ncffn --n-cpu-ffn", "N", REFUSED, PLACEMENT),
    _f("-ngl --gpu-layers --n-gpu-layers", "N", WORKS, "-ngl (a one-line note: upstream's "
       "default placement)"),
    _f("-sm --split-mode", "MODE", REFUSED, SPLIT),
    _f("-ts --tensor-split", "N0,N1,...", REFUSED, SPLIT),
    _f("-mg --main-gpu", "INDEX", REFUSED, SPLIT),
    _f("-fit --fit", "on|off", NOOP, "mtplib fits no setting to device memory: -c/--ctx "
       "is taken as given"),
    _f("-fitt --fit-target", "MIB,...", NOOP, "mtplib fits no setting to device memory: "
       "-c/--ctx is taken as given"),
    _f("-fitc --fit-ctx", "N", NOOP, "mtplib fits no setting to device memory: -c/--ctx "
       "is taken as given"),
    _f("--check-tensors", None, REFUSED, "mtplib does not run upstream's tensor-data check "
       "(it validates the GGUF's header and shapes before loading)"),
    _f("--override-kv", "KEY=TYPE:VALUE,...", REFUSED, "mtplib reads the GGUF's metadata "
       "as written (no override)"),
    _f("--op-offload", None, NOOP, "upstream's default, which mtplib keeps"),
    _f("--no-op-offload", None, REFUSED, "mtplib keeps upstream's default (host ops "
       "offloaded): no setting turns it off"),
    _f("--lora", "FILE", REFUSED, NO_LORA),
    _f("--lora-scaled", "FILE:SCALE,...", REFUSED, NO_LORA),
    _f("--control-vector", "FILE", REFUSED, NO_LORA),
    _f("--control-vector-scaled", "FILE:SCALE,...", REFUSED, NO_LORA),
    _f("--control-vector-layer-range", "START END", REFUSED, NO_LORA),
    _f("-a --alias", "NAME", WORKS, "--alias"),
    _f("--tags", "TAGS", NOOP, "informational model tags: " + ROUTER_ONLY),
    _f("-m --model", "FILE", WORKS, "--model"),
    _f("-mu --model-url", "URL", REFUSED, NO_DOWNLOAD),
    _f("-dr --docker-repo", "REPO", REFUSED, NO_DOWNLOAD),
    _f("-hf -hfr --hf-repo", "REPO", REFUSED, NO_DOWNLOAD),
    _f("-hff --hf-file", "FILE", REFUSED, NO_DOWNLOAD),
    _f("-hft --hf-token", "TOKEN", REFUSED, NO_DOWNLOAD),
    _f("--embd-normalize", "N", NOOP, "an embeddings setting: mtplib serves no embeddings"),
    _f("--host", "HOST", WORKS, "--host (beyond loopback with --allow-remote)"),
    _f("--port", "PORT", WORKS, "--port"),
    _f("--reuse-port", None, REFUSED, "mtplib binds its own listening socket without "
       "SO_REUSEPORT: run one service per port"),
    _f("--path", "PATH", REFUSED, NO_UI),
    _f("--cors-origins", "ORIGINS", REFUSED, CORS),
    _f("--cors-methods", "METHODS", REFUSED, CORS),
    _f("--cors-headers", "HEADERS", REFUSED, CORS),
    _f("--cors-credentials", None, REFUSED, CORS),
    _f("--no-cors-credentials", None, NOOP, "mtplib allows no CORS credentials (the API "
       "key travels in a header)"),
    _f("--api-prefix", "PREFIX", REFUSED, "mtplib serves at the root (/v1/..., /health): "
       "put a reverse proxy in front for a prefix"),
    _f("--ui-config --webui-config", "JSON", NOOP, NO_UI),
    _f("--ui-config-file --webui-config-file", "PATH", NOOP, NO_UI),
    _f("--ui-mcp-proxy --webui-mcp-proxy --no-ui-mcp-proxy --no-webui-mcp-proxy", None,
       NOOP, NO_UI),
    _f("--tools", "TOOLS", REFUSED, NO_TOOLS),
    _f("--tools-runtime", "OPTION", REFUSED, NO_TOOLS),
    _f("--mcp-servers-config", "PATH", REFUSED, NO_TOOLS),
    _f("--mcp-servers-json", "JSON", REFUSED, NO_TOOLS),
    _f("-ag --agent", None, REFUSED, NO_TOOLS),
    _f("-no-ag --no-agent", None, NOOP, NO_TOOLS_OFF),
    _f("--ui --webui", None, REFUSED, NO_UI),
    _f("--no-ui --no-webui", None, NOOP, NO_UI),
    _f("--embedding --embeddings", None, REFUSED, NO_EMBED),
    _f("--rerank --reranking", None, REFUSED, NO_EMBED),
    _f("--api-key", "KEY", WORKS, "--api-key (one key)"),
    _f("--api-key-file", "FILE", WORKS, "the key in FILE, as --api-key (one key; # lines "
       "are comments)"),
    _f("--ssl-key-file", "FILE", REFUSED, "mtplib serves plain HTTP: put a TLS-terminating "
       "proxy in front (mtplib's --tls is the shards' mutual TLS)"),
    _f("--ssl-cert-file", "FILE", REFUSED, "mtplib serves plain HTTP: put a TLS-terminating "
       "proxy in front (mtplib's --tls is the shards' mutual TLS)"),
    _f("--chat-template-kwargs", "JSON", REFUSED, "template variables are not implemented "
       "in mtplib (a request's chat_template_kwargs must be empty too)"),
    _f("-to --timeout", "N", WORKS, "sets --header-timeout and --body-timeout"),
    _f("--sse-ping-interval", "N", REFUSED, "mtplib sends no SSE keep-alive pings"),
    _f("--threads-http", "N", NOOP, "mtplib serves HTTP on one event loop and runs "
       "generations on the model's own thread"),
    _f("--cache-prompt --no-cache-prompt", None, NOOP, _no_cache()),
    _f("--cache-reuse", "N", NOOP, _no_cache(" to reuse")),
    _f("--metrics", None, NOOP, "/metrics is always served"),
    _f("--props", None, REFUSED, "mtplib serves GET /props only: properties are set on "
       "the launch line"),
    _f("--slots", None, NOOP, "/slots is always served"),
    _f("--no-slots", None, NOOP, "mtplib's /slots shows each slot's settings and "
       "counters, never its prompt or output text (behind --api-key when one is set)"),
    _f("--slot-save-path", "PATH", REFUSED, "saving and restoring slots is not "
       "implemented in mtplib"),
    _f("--media-path", "PATH", NOOP, NO_MEDIA),
    _f("--models-dir", "PATH", REFUSED, ROUTER),
    _f("--models-preset", "PATH", REFUSED, ROUTER),
    _f("--models-max", "N", NOOP, ROUTER_ONLY),
    _f("--models-autoload --no-models-autoload", None, NOOP, ROUTER_ONLY),
    _f("--jinja --no-jinja", None, WORKS, "--jinja (the default) renders chat templates "
       "with Jinja; --no-jinja with upstream's built-in formats"),
    _f("--reasoning-format", "FORMAT", NOOP, "mtplib parses no reasoning: thoughts stay in "
       "the content, as llama-server's --reasoning-format none"),
    _f("-rea --reasoning", "on|off|auto", REFUSED, REASONING),
    _f("--reasoning-effort", "LEVEL", REFUSED, REASONING),
    _f("--reasoning-budget", "N", REFUSED, REASONING),
    _f("--reasoning-budget-message", "MESSAGE", REFUSED, REASONING),
    _f("--reasoning-preserve --no-reasoning-preserve", None, REFUSED, REASONING),
    _f("--chat-template", "NAME|JINJA", WORKS, "--chat-template: a built-in name "
       "(upstream's format) or a Jinja template"),
    _f("--chat-template-file", "FILE", WORKS, "--chat-template-file: a Jinja file"),
    _f("--skip-chat-parsing --no-skip-chat-parsing", None, NOOP, "mtplib parses no tool "
       "calls or reasoning: the generated text is the content as is"),
    _f("--prefill-assistant", None, REFUSED, "mtplib always opens a new assistant turn "
       "after the last message (llama-server's --no-prefill-assistant)"),
    _f("--no-prefill-assistant", None, NOOP, "what mtplib does: a new assistant turn "
       "follows the last message"),
    _f("-sps --slot-prompt-similarity", "N", NOOP, "slots are matched to prompts for cache "
       "reuse: mtplib keeps no prompt cache, any free slot runs a request (the output is "
       "the same)"),
    _f("--lora-init-without-apply", None, REFUSED, NO_LORA),
    _f("--sleep-idle-seconds", "SECONDS", REFUSED, "mtplib keeps the model loaded while "
       "it serves (no idle sleep): stop the service to free it"),
    _f("--log-disable", None, NOOP, "upstream's log is silent unless --verbose; mtplib's "
       "own lines (listening, errors) stay"),
    _f("--log-file", "FILE", WORKS, "--log-file (upstream's log lines)"),
    _f("--log-jsonl", None, REFUSED, "mtplib's log lines are plain text (--json prints "
       "the listening line as JSON)"),
    _f("--no-log-jsonl", None, NOOP, LOG_FORMAT),
    _f("--log-prompts-dir", "PATH", REFUSED, "mtplib does not log prompts"),
    _f("--log-colors", "on|off|auto", NOOP, LOG_FORMAT),
    _f("-v --verbose --log-verbose", None, WORKS, "--verbose (upstream's log lines)"),
    _f("--offline", None, NOOP, "mtplib never downloads anything"),
    _f("-lv --verbosity --log-verbosity", "N", REFUSED, "give --verbose for upstream's log "
       "lines (or leave it out: silent)"),
    _f("--log-prefix --no-log-prefix", None, NOOP, LOG_FORMAT),
    _f("--log-timestamps --no-log-timestamps", None, NOOP, LOG_FORMAT),
    _f("--spec-draft-hf -hfd -hfrd --hf-repo-draft", "REPO", REFUSED, NO_DOWNLOAD),
    _f("--spec-draft-threads -td --threads-draft", "N", REFUSED,
       DRAFT_OWN + ": -t/--threads"),
    _f("--spec-draft-threads-batch -tbd --threads-batch-draft", "N", REFUSED,
       DRAFT_OWN + ": -t/--threads"),
    _f("--spec-draft-cpu-mask -Cd --cpu-mask-draft", "M", REFUSED, CPU),
    _f("--spec-draft-cpu-range -Crd --cpu-range-draft", "LO-HI", REFUSED, CPU),
    _f("--spec-draft-cpu-strict --cpu-strict-draft", "0|1", REFUSED, CPU),
    _f("--spec-draft-prio --prio-draft", "N", REFUSED, CPU),
    _f("--spec-draft-poll --poll-draft", "0|1", REFUSED, CPU),
    _f("--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft", "M", REFUSED, CPU),
    _f("--spec-draft-cpu-strict-batch --cpu-strict-batch-draft", "0|1", REFUSED, CPU),
    _f("--spec-draft-prio-batch --prio-batch-draft", "N", REFUSED, CPU),
    _f("--spec-draft-poll-batch --poll-batch-draft", "0|1", REFUSED, CPU),
    _f("--spec-draft-type-k -ctkd --cache-type-k-draft", "TYPE", REFUSED,
       DRAFT_OWN + ": its cache takes the trunk's type (--kv-type, or -ctk/-ctv)"),
    _f("--spec-draft-type-v -ctvd --cache-type-v-draft", "TYPE", REFUSED,
       DRAFT_OWN + ": its cache takes the trunk's type (--kv-type, or -ctk/-ctv)"),
    _f("--spec-draft-override-tensor -otd --override-tensor-draft", "PATTERN=TYPE,...",
       REFUSED, PLACEMENT),
    _f("--spec-draft-cpu-moe -cmoed --cpu-moe-draft", None, REFUSED, PLACEMENT),
    _f("--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft", "N", REFUSED,
       PLACEMENT),
    _f("--spec-draft-n-max", "N", WORKS, "--draft"),
    _f("--spec-draft-n-min", "N", WORKS, "--draft-min (a one-line note)"),
    _f("--spec-synth-len", "L", REFUSED, "synthetic acceptance is a benchmark's: `mtplib "
       "compare-upstream --rates`"),
    _f("--spec-synth-rates", "P0,P1,...", REFUSED, "synthetic acceptance is a benchmark's: "
       "`mtplib compare-upstream --rates`"),
    _f("--spec-draft-p-split --draft-p-split", "P", NOOP, "mtplib's MTP drafts one chain "
       "of --draft K tokens (no split)"),
    _f("--spec-draft-p-min --draft-p-min", "P", NOOP, "mtplib's MTP drafts --draft K "
       "tokens every step (no confidence cut-off)"),
    _f("--spec-draft-backend-sampling --no-spec-draft-backend-sampling", None, NOOP,
       "mtplib picks the drafts on the host (the output is the same)"),
    _f("--spec-draft-device -devd --device-draft", "DEVICES", REFUSED, PLACEMENT),
    _f("--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft", "N", NOOP,
       DRAFT_OWN + ": it is placed with the trunk (see -ngl)"),
    _f("--spec-draft-model -md --model-draft", "FILE", WORKS, "--mtp (the drafter's GGUF)"),
    _f("--spec-type", "TYPE", WORKS, "--spec-type (the drafter -md/--mtp names, or none)"),
    _f("--spec-ngram-mod-n-min", "N", REFUSED, NGRAM),
    _f("--spec-ngram-mod-n-max", "N", REFUSED, NGRAM),
    _f("--spec-ngram-mod-n-match", "N", REFUSED, NGRAM),
    _f("--spec-ngram-simple-size-n", "N", REFUSED, NGRAM),
    _f("--spec-ngram-simple-size-m", "N", REFUSED, NGRAM),
    _f("--spec-ngram-simple-min-hits", "N", REFUSED, NGRAM),
    _f("--spec-ngram-map-k-size-n", "N", REFUSED, NGRAM),
    _f("--spec-ngram-map-k-size-m", "N", REFUSED, NGRAM),
    _f("--spec-ngram-map-k-min-hits", "N", REFUSED, NGRAM),
    _f("--spec-ngram-map-k4v-size-n", "N", REFUSED, NGRAM),
    _f("--spec-ngram-map-k4v-size-m", "N", REFUSED, NGRAM),
    _f("--spec-ngram-map-k4v-min-hits", "N", REFUSED, NGRAM),
    _f("--draft --draft-n --draft-max", "N", WORKS, "--draft"),
    _f("--draft-min --draft-n-min", "N", WORKS, "--draft-min (a one-line note)"),
    _f("--spec-ngram-size-n", "N", REFUSED, NGRAM),
    _f("--spec-ngram-size-m", "N", REFUSED, NGRAM),
    _f("--spec-ngram-min-hits", "N", REFUSED, NGRAM),
    _f("--embd-gemma-default", None, REFUSED, PRESET),
    _f("--fim-qwen-1.5b-default", None, REFUSED, PRESET),
    _f("--fim-qwen-3b-default", None, REFUSED, PRESET),
    _f("--fim-qwen-7b-default", None, REFUSED, PRESET),
    _f("--fim-qwen-7b-spec", None, REFUSED, PRESET),
    _f("--fim-qwen-14b-spec", None, REFUSED, PRESET),
    _f("--fim-qwen-30b-default", None, REFUSED, PRESET),
    _f("--gpt-oss-20b-default", None, REFUSED, PRESET),
    _f("--gpt-oss-120b-default", None, REFUSED, PRESET),
    _f("--vision-gemma-4b-default", None, REFUSED, PRESET),
    _f("--vision-gemma-12b-default", None, REFUSED, PRESET),
    _f("--spec-default", None, REFUSED, "llama.cpp's n-gram drafting preset: " + NGRAM),
)

#: llama-server spellings of serve options defined without them (they keep mtplib's own
#: spelling on the other verbs): {spelling: serve's option}
SERVE_ALIASES: dict[str, str] = {
    "-s": "--seed", "--temperature": "--temp", "-a": "--alias", "-v": "--verbose",
    "--log-verbose": "--verbose", "--predict": "--n", "--draft-n": "--draft",
    "--spec-draft-model": "--mtp",
}
