"""What the proofs found: each proof's checks and figures, written as `gpu.json` (every
figure, the machine) and `gpu.md` (the table docs/benchmarks.md takes)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec


class Check(msgspec.Struct, kw_only=True):
    what: str
    ok: bool
    detail: str = ""
    judged: bool = True
    """False: a goal for a GPU at full size, recorded but not judged in this mode."""


class Proof(msgspec.Struct, kw_only=True):
    key: str
    title: str
    seconds: float = 0.0
    figures: dict[str, Any] = {}
    checks: list[Check] = []
    error: str = ""

    @property
    def passed(self) -> bool:
        judged = [c.ok for c in self.checks if c.judged]
        return not self.error and bool(judged) and all(judged)


class Proving:
    """Handed to a proof while it runs: it records checks and figures, never raises on a
    failed check, so every figure of a failing proof is still written."""

    def __init__(self, proof: Proof, goals: bool) -> None:
        self.proof = proof
        self.goals = goals

    def check(self, ok: bool, what: str, detail: object = "") -> bool:
        """Something that must hold in every mode (bits, processes, what CUDA saw)."""
        self.proof.checks.append(Check(what=what, ok=bool(ok), detail=str(detail)))
        return bool(ok)

    def goal(self, ok: bool, what: str, detail: object = "") -> bool:
        """A performance goal: judged on a GPU at full size only (tiny sizes on a CPU say
        nothing about it), recorded everywhere."""
        check = Check(what=what, ok=bool(ok), detail=str(detail), judged=self.goals)
        self.proof.checks.append(check)
        return bool(ok)

    def figure(self, name: str, value: Any) -> Any:
        self.proof.figures[name] = round(value, 6) if isinstance(value, float) else value
        return value


class Report(msgspec.Struct, kw_only=True):
    date: str = msgspec.field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    mode: str
    machine: dict[str, Any] = {}
    budget_s: float
    seconds: float = 0.0
    proofs: list[Proof] = []
    leftovers: list[str] = []
    """Processes of the stack still running after it was stopped (SIGKILLed then)."""
    audit: list[str] = []
    """What the stack's logs must never say (`tests.support.audit`): a permission refused,
    a failed sweep, a JetStream API timeout."""

    @property
    def passed(self) -> bool:
        clean = not self.leftovers and not self.audit
        return bool(self.proofs) and all(p.passed for p in self.proofs) and clean

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        data = msgspec.to_builtins(self)
        data["passed"] = self.passed
        for proof, raw in zip(self.proofs, data["proofs"], strict=True):
            raw["passed"] = proof.passed
        (out / "gpu.json").write_text(json.dumps(data, indent=2) + "\n")
        (out / "gpu.md").write_text(markdown(self))


def markdown(r: Report) -> str:
    m = r.machine
    lines = [
        f"# Baton on {m.get('gpu') or 'a CPU'} — {'passed' if r.passed else 'FAILED'}",
        "",
        f"{r.date}; mode {r.mode}; torch {m.get('torch')}, CUDA {m.get('cuda') or '-'}, "
        f"cuDNN {m.get('cudnn') or '-'}, driver {m.get('driver') or '-'}, Python "
        f"{m.get('python')}; {r.seconds:.0f} s of a {r.budget_s:.0f} s budget.",
        "",
        "| proof | result | figures | time |",
        "| --- | --- | --- | --- |",
    ]
    for p in r.proofs:
        shown = "; ".join(f"{k} {_fmt(v)}" for k, v in p.figures.items() if _shown(v))
        verdict = "passed" if p.passed else "**FAILED**"
        lines.append(f"| {p.title} | {verdict} | {shown} | {p.seconds:.0f} s |")
    lines += ["", "## Checks", ""]
    for p in r.proofs:
        for c in p.checks:
            mark = ("ok" if c.ok else "FAILED") if c.judged else ("met" if c.ok else "not met")
            judged = "" if c.judged else " (goal, not judged in this mode)"
            detail = f": {c.detail}" if c.detail else ""
            lines.append(f"- {p.key}: {c.what} — {mark}{judged}{detail}")
        if p.error:
            lines.append(f"- {p.key}: error — {p.error}")
    if r.leftovers:
        lines += ["", "Processes left running after the stack stopped (killed):", ""]
        lines += [f"- {x}" for x in r.leftovers]
    if r.audit:
        lines += ["", "The stack's logs said what no run may cause:", ""]
        lines += [f"- {x}" for x in r.audit]
    return "\n".join(lines) + "\n"


def _shown(v: Any) -> bool:
    return isinstance(v, int | float | str | bool) and v != ""


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
