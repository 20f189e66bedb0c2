"""The example script trains the same model under our launcher and, unchanged, under ``torchrun``.

Every layout is a data-parallel split of the same batches from the same initial weights, so the loss
curves of DDP, ZeRO-1/2/3 and a 3D layout (here TP = 2) must agree to float32 rounding, whoever
started the processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from llmedu.parallel.example import main

pytestmark = pytest.mark.slow

STEPS = ["--steps", "3", "--d-model", "32", "--seq-len", "32"]


def _losses(output: str) -> list[float]:
    return json.loads(output.strip().splitlines()[-1])["losses"]


def test_layouts_agree_under_our_launcher(capsys):
    curves = {}
    for layout in ("ddp", "zero3"):
        assert main(["--layout", layout, "--ranks", "2", *STEPS]) == 0
        curves[layout] = _losses(capsys.readouterr().out)
    assert len(curves["ddp"]) == 3 and curves["ddp"][-1] < curves["ddp"][0]
    assert curves["zero3"] == pytest.approx(curves["ddp"], abs=1e-4)


def test_the_same_module_runs_under_torchrun(capsys):
    """The module under torchrun (its command line, its own process) against our launcher started from here:
    a second interpreter for the reference would only import torch once more."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun comes with torch; it must be on the PATH of this Python"
    command = [torchrun, "--nproc-per-node", "2", "-m", "llmedu.parallel.example", "--layout", "3d", "--tp", "2"]
    done = subprocess.run([*command, *STEPS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(["--layout", "zero2", "--ranks", "2", *STEPS]) == 0
    assert _losses(done.stdout) == pytest.approx(_losses(capsys.readouterr().out), abs=1e-4)


def test_bad_layouts_are_clear_errors(capsys):
    with pytest.raises(SystemExit):
        main(["--layout", "zero4"])
    assert "invalid choice: 'zero4'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layout", "3d", "--ranks", "2", "--tp", "4"], "--tp 4 x --pp 1 = 4 does not divide the world size 2"),
        (["--layout", "3d", "--ranks", "4", "--tp", "2", "--batch", "7"], "--batch 7 does not split over 2"),
        (
            ["--layout", "3d", "--ranks", "2", "--tp", "1", "--pp", "2", "--layers", "3"],
            "--pp 2 must divide --layers 3",
        ),
        (["--layout", "3d", "--ranks", "3", "--tp", "3"], "--tp 3 must divide the model's 4 heads"),
        (["--layout", "zero2", "--ranks", "3"], "--batch 8 does not split evenly over 3 ranks"),
        (["--layout", "ddp", "--tp", "2"], "--tp and --pp apply to the 3d layout only"),
        (["--d-model", "30"], "--d-model 30 must be a multiple of the model's 4 heads"),
        (["--batch", "0"], "--batch must be at least 1, got 0"),
        (["--seq-len", "2000"], "--seq-len 2000 is longer than the model's 1024"),
    ],
)
def test_a_bad_layout_is_one_line_before_any_process_starts(args, message, capsys, monkeypatch):
    import llmedu.parallel.example as example

    def no_launch(*args, **kwargs):
        raise AssertionError("launch was called: the arguments must be checked before any process starts")

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(example, "launch", no_launch)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err
