"""Print the pinned requirements an image layer installs, read from pyproject.toml.

`light`: what `marl serve sandbox` imports (gRPC, protobuf, pydantic, YAML,
aiohttp for its HTTP front end and prometheus-client for its /metrics) — the sandbox image stops there, so untrusted
code shares its interpreter with as few packages as possible. `heavy`: everything else in `[project] dependencies`
except torch, which the Dockerfile installs first from a wheel it is handed.
Keeping the list in pyproject.toml alone means an image never drifts from
`pip install marl`.
Usage: python requirements.py light|heavy PYPROJECT
"""

import re
import sys
import tomllib

LIGHT = {
    "aiohttp",
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "prometheus-client",
    "protobuf",
    "pydantic",
    "pyyaml",
}


def name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()


def main() -> None:
    group, path = sys.argv[1], sys.argv[2]
    with open(path, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    if group == "light":
        chosen = [d for d in deps if name(d) in LIGHT]
    elif group == "heavy":
        chosen = [d for d in deps if name(d) not in LIGHT and name(d) != "torch"]
    else:
        raise SystemExit(f"group must be light or heavy, not {group!r}")
    print("\n".join(chosen))


if __name__ == "__main__":
    main()
