"""What the tests and the benches share: the cluster fixture (`cluster`), the small run
spec (`specs`), the Runs API helpers (`runs`) and the planted-drift runs (`drift`).

Importable as `tests.support` from the repository root (pytest's `pythonpath`, and the
editable install's path entry for the benches and the service processes)."""
