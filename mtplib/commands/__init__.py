"""One module per `mtplib` sub-command; each exposes ``register(subparsers)``.

Adding a command = adding a module here and its name to COMMANDS (order = --help order).
"""

COMMANDS = ["fixture", "inventory", "generate", "serve", "shard", "tls", "run", "bench",
            "evidence", "info", "check-hidden", "compare-upstream", "layer-cost"]
