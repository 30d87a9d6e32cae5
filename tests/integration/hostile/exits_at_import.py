"""A module whose top level ends the interpreter (as `venv.__main__` does when imported)."""

raise SystemExit(3)
