"""examples/run_pipeline.py on your own files, killed with SIGKILL at named points and run again (issue 60): the rerun
resumes (from the newest whole fine-tuning checkpoint, or the step again) and writes the report of an uninterrupted
run. Each kill is real: the run is a forked copy of this process that sends itself SIGKILL where a test-side patch
names the point (inside the Trainer's checkpoint writing, between a step's result and its mark, inside mask training,
inside evaluation), so no point depends on timing; a tiny random BERT and tiny CSV files keep it to seconds."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import run_evaluate  # noqa: E402
import run_pipeline  # noqa: E402
import test_examples_pipeline  # noqa: E402

own_task = test_examples_pipeline.own_task  # the fixture of the tiny BERT and CSV files, shared

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="the killed runs are forked copies of this process"),
]

FT_STEPS, SAVE_STEPS = 6, 2  # fine-tuning checkpoints at steps 2, 4 and 6 (the last one kept)


def _flags(own_task, root: Path) -> list[str]:
    """The README's own-file command with the main run's settings (fine-tuning checkpointed), at smoke size."""
    return [
        "--train_file", own_task["train"], "--validation_file", own_task["dev"], "--test_file", own_task["test"],
        "--text_column", "review", "--label_column", "stars", "--model_name_or_path", own_task["model"],
        "--ft_steps", str(FT_STEPS), "--save_steps", str(SAVE_STEPS), "--mask_steps", "4", "--mask_batch", "8",
        "--fractions", "0.01", "--work_dir", str(root / "work"), "--report_dir", str(root / "report"),
    ]  # fmt: skip


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_at(point: str, patch: pytest.MonkeyPatch) -> None:
    """Make this process kill itself at ``point``."""
    import transformers

    from peft_graft import MaskTrainer

    if point == "inside a fine-tuning checkpoint":  # its weights written, not its optimizer nor trainer_state.json
        save = transformers.Trainer._save_optimizer_and_scheduler

        def cut(self, output_dir):
            if output_dir.endswith(f"checkpoint-{2 * SAVE_STEPS}"):
                _kill()
            return save(self, output_dir)

        patch.setattr(transformers.Trainer, "_save_optimizer_and_scheduler", cut)
    elif point.startswith("after the result of "):  # the step's result written, its mark not yet
        folder, write_mark = point.removeprefix("after the result of "), run_pipeline.write_mark

        def unmarked(mark, done):
            if mark.parent.name == folder:
                _kill()
            write_mark(mark, done)

        patch.setattr(run_pipeline, "write_mark", unmarked)
    elif point == "inside mask training":
        step = MaskTrainer.training_step

        def killed_step(self, *args, **kwargs):
            if self.state.global_step == 2:
                _kill()
            return step(self, *args, **kwargs)

        patch.setattr(MaskTrainer, "training_step", killed_step)
    elif point == "inside evaluation":  # results.json of the step written, the predictions and the summary not
        patch.setattr(run_evaluate, "write_predictions", lambda *args, **kwargs: _kill())
    else:
        raise ValueError(point)


def _killed_run(flags: list[str], point: str, steps: Path) -> None:
    """``run_pipeline.main(flags)`` in a forked copy of this process, killed with SIGKILL at ``point``; the steps it
    starts recorded in ``steps``."""
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():  # (Python 3.12+ warns of fork in a process with threads: the child runs one)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            torch.set_num_threads(1)
            with pytest.MonkeyPatch.context() as patch:
                _kill_at(point, patch)
                _record_steps(steps, patch)
                run_pipeline.main(flags)
        finally:
            os._exit(3)  # the point was not reached
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"not killed {point}: status {status}"


def _report(root: Path) -> dict:
    """The run's results.json without its run times, its folders written relative to ``root``."""
    results = json.loads((root / "report" / "results.json").read_text().replace(str(root), "<root>"))
    results.pop("timings")
    return results


@pytest.fixture(scope="module")
def uninterrupted(own_task, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    run_pipeline.main(_flags(own_task, root))
    return root


# In this order each rerun starts where the last one was killed: the fine-tune done but unmarked (run again), cut
# inside its second checkpoint (resumed from the first), mask training cut, the graft done but unmarked, the report cut.
KILL_POINTS = [
    "after the result of finetuned",
    "inside a fine-tuning checkpoint",
    "inside mask training",
    "after the result of graft_0.01",
    "inside evaluation",
]


def test_killed_at_every_point_then_rerun_gives_the_uninterrupted_report(own_task, uninterrupted, tmp_path):
    """Killed at each point in turn, then run to the end: the same report, predictions, fine-tune and graft as an
    uninterrupted run; each rerun runs only the steps not done (the fine-tune resumed from its whole checkpoint)."""
    flags = _flags(own_task, tmp_path)
    run = tmp_path / "work" / run_pipeline.own_run_name(own_task["train"])
    finetuned, steps = run / "finetuned", tmp_path / "steps.jsonl"
    for point in KILL_POINTS:
        _killed_run(flags, point, steps)
        if point == "inside a fine-tuning checkpoint":  # the cut checkpoint is what a rerun must not resume from
            cut = finetuned / f"checkpoint-{2 * SAVE_STEPS}"
            assert (cut / "model.safetensors").is_file() and not (cut / "trainer_state.json").exists()
            assert run_pipeline.checkpoint_problem(cut) == "no trainer_state.json, optimizer.pt, scheduler.pt, " \
                "rng_state.pth"  # fmt: skip
            assert run_pipeline.checkpoint_problem(finetuned / f"checkpoint-{SAVE_STEPS}") is None
        if point.startswith("after the result of "):  # a result without its mark
            assert not (run / point.split()[-1] / run_pipeline.MARK).exists()
    with pytest.MonkeyPatch.context() as patch:
        _record_steps(steps, patch)
        results = run_pipeline.main(flags)
    ran = [json.loads(line) for line in steps.read_text().splitlines()]
    # fine-tune (unmarked), fine-tune (cut), fine-tune resumed + graft (cut), graft (unmarked), graft + evaluate
    # (cut), evaluate
    assert [script for script, _ in ran] == ["run_finetune"] * 3 + ["run_graft"] * 3 + ["run_evaluate"] * 2
    resumed = [
        argv[argv.index("--resume_from_checkpoint") + 1] for _, argv in ran[:3] if "--resume_from_checkpoint" in argv
    ]
    assert resumed == [str(finetuned / f"checkpoint-{SAVE_STEPS}")]  # the third run, and only from the whole one
    assert not list(finetuned.glob("checkpoint-*"))

    assert _report(tmp_path) == _report(uninterrupted)
    assert results["metrics"] == json.loads((uninterrupted / "report" / "results.json").read_text())["metrics"]
    for name in ("predict_results.csv", "summary.md"):
        ours, theirs = (root / "report" / name for root in (tmp_path, uninterrupted))
        assert _without_times(ours.read_text(), tmp_path) == _without_times(theirs.read_text(), uninterrupted), name
    theirs = uninterrupted / "work" / run.name
    for folder, weights in (("finetuned", "model.safetensors"), ("graft_0.01", "adapter_model.safetensors")):
        ours_, theirs_ = load_file(run / folder / weights), load_file(theirs / folder / weights)
        assert ours_.keys() == theirs_.keys() and all(torch.equal(ours_[k], theirs_[k]) for k in ours_), folder


def _without_times(text: str, root: Path) -> str:
    """``text`` with its run times (the total in minutes, the table of stage times) and ``root`` blanked."""
    text = text.replace(str(root), "<root>").split("| stage | run time (s) |")[0]
    return re.sub(r"total run time [\d.]+ min", "total run time <time>", text)


def _record_steps(path: Path, patch: pytest.MonkeyPatch) -> None:
    """Append each step's script and arguments to ``path`` (a JSON line each) as the pipeline runs it."""
    run_step = run_pipeline.U.run_step

    def recorded(script, argv, script_logger):
        with path.open("a") as handle:
            handle.write(json.dumps([script.__name__, argv]) + "\n")
        return run_step(script, argv, script_logger)

    patch.setattr(run_pipeline.U, "run_step", recorded)
