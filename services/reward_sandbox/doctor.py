"""`marl sandbox doctor`: which isolation tier this machine allows, and what it protects.

Runs the same probes as the server (the real jail set-up, in forked children)
and prints the tier, each layer with what it protects, what is not protected,
and why any stronger tier is unavailable. Exit status 0 whatever the tier: a
lower tier is a fact about the kernel, not an error. `--json` prints one JSON
object instead.
"""

from __future__ import annotations

import argparse
import json
import sys

from marl.spec.services import load_sandbox

from . import tiers
from .forkserver_client import single_threaded_probe


def report(config_path: str | None = None) -> dict[str, object]:
    cfg = load_sandbox(config_path)
    probed = single_threaded_probe({"isolation": cfg.isolation, "tmp_bytes": cfg.tmp_bytes,
                                    "tmp_inodes": cfg.tmp_inodes,
                                    "max_processes": cfg.max_processes,
                                    "max_memory_bytes": cfg.max_memory_bytes,
                                    "max_jobs": cfg.max_concurrency + cfg.warm_jails + 1})
    tier = probed["tier"]
    return {"tier": tier, "probes": probed["probes"],
            "layers": [{"name": n, "protects": p} for n, p in tiers.layers(tier)],
            "not_protected": tiers.NOT_PROTECTED}


def main(argv: list[str] | None = None) -> int:
    """Print the report (`python -m services.reward_sandbox.doctor`; `marl sandbox doctor`
    calls `show`)."""
    parser = argparse.ArgumentParser(prog="marl sandbox doctor", description=__doc__)
    parser.add_argument("--config", default=None, help="sandbox config YAML")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv or [])
    try:
        return show(args.config, args.json)
    except ValueError as e:
        print(f"error: {e}")
        return 2


def show(config: str | None, as_json: bool) -> int:
    """Print the report (one JSON object with `as_json`); a bad config raises ValueError."""
    rep = report(config)
    if as_json:
        print(json.dumps(rep))
        return 0
    print(f"isolation tier: {rep['tier']}")
    for name, result in rep["probes"].items():  # type: ignore[attr-defined]
        status = "available" if result == "ok" else f"unavailable ({result.strip()})"
        print(f"  probe {name}: {status}")
    print("\nprotected:")
    for layer in rep["layers"]:  # type: ignore[attr-defined]
        print(f"  - {layer['name']}: {layer['protects']}")
    print("\nnot protected:")
    for item in rep["not_protected"]:  # type: ignore[attr-defined]
        print(f"  - {item}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
