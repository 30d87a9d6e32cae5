"""The `marl` command: `main` parses and dispatches; each group of subcommands has a module."""
