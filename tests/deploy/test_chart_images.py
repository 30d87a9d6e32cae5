"""The chart pulls exactly the images `make images` builds, with the registry and tag set.

`scripts/build_images.sh` with LIST=1 prints the names it would build (REGISTRY/marl-
<target>:TAG); the chart rendered with `image.registry` and `image.tag` set the same way
must name those images for every marl workload: the CPU targets with
deploy/helm/ci/cpu-values.yaml, the CUDA ones (inference-cuda, learner-cuda) with the
default values.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.support.chart import CHART, ROOT, render, workloads

REGISTRY, TAG = "registry.example.com/team", "1.2.3"


def built(*targets: str, tag: str | None = TAG) -> set[str]:
    env = {"PATH": "/usr/bin:/bin", "LIST": "1", "REGISTRY": REGISTRY}
    if tag is not None:
        env["TAG"] = tag
    out = subprocess.run(["bash", "scripts/build_images.sh", *targets], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def pulled(values: str | None, *sets: str) -> set[str]:
    docs = render(None if values is None else CHART / "ci" / values,
                  f"image.registry={REGISTRY}", *sets)
    return {
        c["image"]
        for w in workloads(docs).values()
        for c in w["spec"]["template"]["spec"]["containers"]
        if "/marl-" in c["image"]
    }


@pytest.mark.parametrize(
    ("values", "targets"),
    [("cpu-values.yaml", ()),  # the script's default targets: the CPU images
     (None, ("sandbox", "workflow", "inference-cuda", "learner-cuda"))],
)
def test_chart_images_are_the_ones_make_images_builds(
    values: str | None, targets: tuple[str, ...]
) -> None:
    assert pulled(values, f"image.tag={TAG}") == built(*targets)


def test_default_tag_is_the_charts_app_version() -> None:
    assert pulled("cpu-values.yaml") == built(tag=None)
