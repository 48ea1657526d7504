"""One module per ksim subcommand; each exposes register(subparsers)."""
