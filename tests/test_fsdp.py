"""A graft model under real FSDP, 2 CPU processes (gloo): FSDP v1 is refused at forward, FSDP2's unmerged forward is
exact and merging under it is refused."""

from __future__ import annotations

import os

import pytest
from testing_utils import TORCHRUN, run_command

SCRIPT = os.path.join(os.path.dirname(__file__), "fsdp_graft_script.py")


def results(kind: str, tmp_path) -> list[list[str]]:
    run_command([*TORCHRUN, SCRIPT, kind], tmp_path)
    return [(tmp_path / f"rank{rank}.txt").read_text().splitlines() for rank in (0, 1)]


@pytest.mark.multiprocess
def test_fsdp_v1_is_refused_at_forward_and_merge(tmp_path):
    for forward, merge in results("fsdp1", tmp_path):
        assert forward.startswith("forward refused: A graft layer") and "runs under FSDP v1" in forward
        assert merge.startswith("merge refused: A graft layer") and "runs under FSDP v1" in merge


@pytest.mark.multiprocess
def test_fsdp2_forward_is_exact_and_merging_is_refused(tmp_path):
    for forward, merge in results("fsdp2", tmp_path):
        assert forward == "forward exact: True"
        assert merge.startswith("merge refused: A graft layer") and "is sharded by FSDP2 and cannot be merged" in merge
