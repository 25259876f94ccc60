"""This checkout beside a git revision: a benchmark script run in fresh processes of each, alternating which goes
first (``--against REV`` of ``bench_merge.py`` and ``bench_served_grafts.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def alternate(script: str, arguments: list[str], revision: str, rounds: int) -> dict[str, list[dict]]:
    """This checkout's ``benchmarks/<script> <arguments>``, ``rounds`` times in a fresh process with this checkout's
    code and one with ``revision``'s (a temporary git worktree, on ``PYTHONPATH``), the order alternating round by
    round: the JSON line each process prints last, per way (``"this"``, ``"against"``)."""
    outputs: dict[str, list[dict]] = {"this": [], "against": []}
    with tempfile.TemporaryDirectory() as folder:
        other = Path(folder) / "code"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), revision], check=True)
        try:
            for r in range(rounds):
                for way in ("this", "against") if r % 2 == 0 else ("against", "this"):
                    code = ROOT if way == "this" else other
                    command = [sys.executable, str(ROOT / "benchmarks" / script), *arguments]
                    env = {**os.environ, "PYTHONPATH": str(code)}
                    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
                    outputs[way].append(json.loads(out.splitlines()[-1]))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=True)
    return outputs
