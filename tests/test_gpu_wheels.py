"""scripts/gpu-wheels.sh's lists in step with pyproject.toml: every runtime dependency is
carried to a lent GPU machine (a version that satisfies pyproject's), in the device's image,
or left behind — and what is left behind is imported by nothing the proofs run."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-wheels.sh"

LEFT_MODULES = {
    "aioboto3": ("aioboto3", "aiobotocore", "botocore", "boto3"),
    "opentelemetry-exporter-otlp-proto-http": ("opentelemetry.exporter",),
    "matplotlib": ("matplotlib",),
    "starlette": ("starlette",),
    "uvicorn": ("uvicorn",),
    "aiohttp": ("aiohttp",),
    "anyio": ("anyio",),
}
"""What each left-behind distribution is imported as."""

RUN_TIME = [
    "baton.cli.app", "baton.stack.lifecycle", "services.dispatcher.service",
    "services.checkpointer.service", "services.reaper.service", "services.trainer.service",
    "services.trainer.child", "baton.runtime.context", "baton.runtime.group",
    "bench.gpu.__main__", "bench.gpu.jobs",
]  # fmt: skip
"""What `baton up`, its services, a training process and the proofs import (the Hugging Face
job imports transformers and accelerate, which the image has)."""


def array(name: str) -> list[str]:
    """A bash array of the script (`NAME=(a b)`, or one item a line up to a line `)`), its
    comments dropped."""
    lines = iter(SCRIPT.read_text().splitlines())
    for line in lines:
        if line.startswith(f"{name}=("):
            first = line.split("#", 1)[0][len(name) + 2 :].strip()
            if first.endswith(")"):
                return first[:-1].split()
            words = first.split()
            for item in lines:
                if item.strip() == ")":
                    return words
                words += item.split("#", 1)[0].split()
    raise AssertionError(f"no {name}=(…) in {SCRIPT.name}")


def carried() -> dict[str, str]:
    out: dict[str, str] = {}
    for item in array("CARRIED"):
        name, sep, version = item.partition("==")
        assert sep and version, f"{item}: carried wheels are pinned, NAME==VERSION"
        out[canonicalize_name(name)] = version
    return out


def project() -> dict[str, Any]:
    found: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return found


def runtime() -> list[Requirement]:
    return [Requirement(r) for r in project()["dependencies"]]


def test_every_runtime_dependency_is_carried_in_the_image_or_left_behind() -> None:
    image = {canonicalize_name(n) for n in array("IMAGE")}
    left = {canonicalize_name(n) for n in array("LEFT")}
    wheels = carried()
    for req in runtime():
        name = canonicalize_name(req.name)
        where = [k for k, names in (("carried", wheels), ("image", image), ("left", left))
                 if name in names]  # fmt: skip
        assert len(where) == 1, f"{req}: in {where or 'no list'} of {SCRIPT.name}; one only"
        if name in wheels:
            assert req.specifier.contains(wheels[name], prereleases=True), (
                f"{SCRIPT.name} carries {name}=={wheels[name]}; pyproject.toml wants {req}"
            )
        for extra in req.extras:  # nats-py[nkeys]: the extra's packages come along
            assert canonicalize_name(extra) in wheels, f"{req}: {extra} is not carried"
    named = {canonicalize_name(r.name) for r in runtime()}
    frameworks = {
        canonicalize_name(Requirement(r).name)
        for extra in ("hf", "accelerate", "lightning")
        for r in project()["optional-dependencies"][extra]
    }
    assert left <= named, f"left behind, not a dependency: {sorted(left - named)}"
    assert image <= named | frameworks, f"in the image, not used: {sorted(image - named)}"
    assert set(LEFT_MODULES) == left, "LEFT_MODULES names what each left one imports as"


def test_what_is_left_behind_is_not_needed_at_run_time() -> None:
    """The run time's modules import with every left-behind package unimportable (an
    optional import, as nats-py's of aiohttp, may try and must not need it)."""
    blocked = sorted({m for ms in LEFT_MODULES.values() for m in ms})
    script = f"""
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"left behind: {{name}}", name=name)
        return None
sys.meta_path.insert(0, Block())
for module in {RUN_TIME!r}:
    importlib.import_module(module)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
