"""llmedu.runtime: device choice, seeding, the fast-mode switch, the timer; llmedu.show."""

import os
import random

import numpy as np
import pytest
import torch

import llmedu
from llmedu import runtime


def test_fast_mode_is_on_in_tests():
    assert runtime.FAST is True  # conftest sets LLMEDU_FAST=1 before llmedu is imported


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1", True),
        ("TRUE", True),
        (" on ", True),
        ("yes", True),
        ("0", False),
        ("off", False),
        ("False", False),
    ],
)
def test_fast_mode_parses(value, expected):
    assert runtime.fast_mode(value) is expected


@pytest.mark.parametrize("has_cuda, expected", [(False, True), (True, False)])
def test_unset_mode_follows_the_machine(has_cuda, expected):
    # a laptop opening a lesson gets minutes, not hours; a GPU gets the real experiment
    assert runtime.fast_mode("", has_cuda=has_cuda) is expected
    assert runtime.fast_mode("  ", has_cuda=has_cuda) is expected


def test_mode_banner_says_the_mode_and_the_switch(monkeypatch):
    banner = runtime.mode_banner()
    assert banner.startswith("fast mode (LLMEDU_FAST=1)")  # conftest sets it
    assert "%env LLMEDU_FAST=0" in banner
    monkeypatch.setattr(runtime, "FAST", False)
    monkeypatch.setenv("LLMEDU_FAST", "0")
    assert runtime.mode_banner().startswith("full mode (LLMEDU_FAST=0)")
    assert "%env LLMEDU_FAST=1" in runtime.mode_banner()


def test_the_banner_names_the_machine():
    # "this machine" in a lesson must mean one thing: the banner's second line names the CPU and its threads
    mode, machine = runtime.mode_banner().split("\n")
    assert machine == f"machine: {runtime.machine()}"
    assert f"{os.cpu_count()} logical CPUs" in machine
    assert f"({torch.get_num_threads()} torch threads)" in machine


@pytest.mark.parametrize("value", ["2", "fast", "y", "maybe"])
def test_fast_mode_rejects_nonsense(value):
    with pytest.raises(ValueError, match="LLMEDU_FAST"):
        runtime.fast_mode(value)


def test_nonsense_fast_mode_stops_import(monkeypatch):
    import importlib

    monkeypatch.setenv("LLMEDU_FAST", "sure")
    with pytest.raises(ValueError, match="not understood"):
        importlib.reload(runtime)
    monkeypatch.setenv("LLMEDU_FAST", "1")
    importlib.reload(runtime)


def test_device_prefers_accelerators():
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert runtime.device().type == expected
    assert runtime.device("cpu") == torch.device("cpu")


def test_an_accelerator_comes_with_its_index(monkeypatch):
    # unindexed, torch.device("cuda") != a tensor's cuda:0, and lesson 06 keyed a dict by it (a KeyError on a GPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert runtime.device() == torch.device("cuda", 1)
    assert runtime.device("cuda") == torch.device("cuda", 1)
    assert runtime.device("cuda:0") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert runtime.device() == torch.device("mps", 0)


def test_device_refuses_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="not available"):
        runtime.device("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu': llmedu runs on cpu, cuda, mps"):
        runtime.device("tpu")


def test_autocast_dtype_on_cpu_is_bf16():
    assert runtime.autocast_dtype("cpu") is torch.bfloat16


def test_seed_everything_reproduces_every_generator():
    def draw():
        return random.random(), np.random.rand(), torch.rand(3)

    runtime.seed_everything(123)
    a = draw()
    runtime.seed_everything(123)
    b = draw()
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
    g1, g2 = runtime.seed_everything(7), runtime.seed_everything(7)
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))
    runtime.seed_everything(124)
    assert draw()[0] != a[0]


@pytest.mark.parametrize("seed", [-1, 1.5, "3", True])
def test_seed_everything_rejects_bad_seeds(seed):
    with pytest.raises(ValueError):
        runtime.seed_everything(seed)


def test_timer_measures_and_laps():
    import time

    with runtime.Timer() as t:
        time.sleep(0.01)
        first = t.lap()
        time.sleep(0.01)
        t.lap()
    assert first >= 0.009 and len(t.laps) == 2
    assert t.seconds >= sum(t.laps) - 1e-9


def test_show_prints_source(capsys):
    llmedu.show(runtime.seed_everything)
    out = capsys.readouterr().out
    assert out.startswith("def seed_everything(seed: int)") and "manual_seed" in out


def test_show_refuses_objects_without_source():
    with pytest.raises(TypeError, match="cannot show"):
        llmedu.show(42)


def test_a_shown_command_names_files_not_the_recording_machines_folders():
    recorded = "python -m llmedu.peft.study run --methods 'prefix tuning' --out /work/notes/peft/partA.json ; x --out data/r.json"
    shown = runtime.shown_command(recorded)
    assert shown == "python -m llmedu.peft.study run --methods 'prefix tuning' --out partA.json ; x --out data/r.json"
