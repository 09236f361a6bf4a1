"""``--prr-*`` flags: generated from PRRConfig, shown in --help, validated with clear errors."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_prr.config import PRRConfig
from sglang_prr.flags import flag_name
from sglang_prr.serving.server_args_patch import complete_argv

REPO = Path(__file__).resolve().parents[2]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _launch(*args, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SGLANG_PRR_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "sglang_prr.launch_server", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO))


def test_help_lists_every_prr_flag_next_to_sglang():
    p = _launch("--help")
    assert p.returncode == 0, p.stderr[-2000:]
    for f in dataclasses.fields(PRRConfig):
        assert flag_name(f.name) in p.stdout, f"{flag_name(f.name)} missing from --help"
    assert "--page-size" in p.stdout and "--attention-backend" in p.stdout


def test_bad_flag_exits_nonzero_from_the_command_line():
    p = _launch("--model-path", "/nonexistent-model", "--prr-top-k", "0")
    assert p.returncode == 2
    assert "invalid PRR option top_k=0: allowed an integer >= 1" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("args, needle", [
    (["--prr-top-k", "0"], "top_k=0"),
    (["--prr-block-size", "48"], "block_size=48"),
    (["--prr-budget", "0.5"], "budget=0.5"),
    (["--prr-calib-alphas", "0.5,1.5"], "calib_alphas"),
    (["--prr-serial", "maybe"], "--prr-serial"),
    (["--prr-block-size", "16", "--page-size", "32"], "--page-size=32"),
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm=EAGLE"),
    (["--enable-mixed-chunk"], "--enable-mixed-chunk"),
    pytest.param(["--attention-backend", "fa3"], "--attention-backend=fa3",
                 marks=pytest.mark.skipif(_cuda(), reason="fa3 is valid with a GPU")),
])
def test_bad_flags_exit_nonzero_with_message(args, needle, capsys, monkeypatch):
    from sglang_prr.serving import launch_server

    monkeypatch.delenv("SGLANG_PRR_CONFIG", raising=False)
    # A model path is given so no demo is built: the checks run before anything is loaded.
    with pytest.raises(SystemExit) as e:
        launch_server.prepare(["--model-path", "/nonexistent-model", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert needle in err, err[-2000:]
    assert any(w in err for w in ("allowed", "must", "not supported", "invalid")), err


def test_good_flags_pass_validation(monkeypatch):
    """Negative control for the test above: a valid combination is accepted up to the model."""
    from sglang_prr.serving import launch_server
    from sglang_prr.serving.server_args_patch import PRRArgsError, check_compatibility

    ns = launch_server.build_parser().parse_args(
        ["--model-path", "m", "--page-size", "16", "--prr-block-size", "16"])
    from sglang_prr.flags import pop_prr_args
    from sglang_prr.serving.server_args_patch import config_from_given

    cfg = config_from_given(pop_prr_args(ns))
    check_compatibility(cfg, ns, has_cuda=False)  # no exception
    ns.page_size = 32
    with pytest.raises(PRRArgsError):
        check_compatibility(cfg, ns, has_cuda=False)


def test_complete_argv_cpu_defaults():
    argv, notes = complete_argv(["--prr-block-size", "32"], has_cuda=False,
                                demo_path_fn=lambda: "/demo")
    assert argv[argv.index("--model-path") + 1] == "/demo"
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"
    assert argv[argv.index("--page-size") + 1] == "32"
    assert "--disable-cuda-graph" in argv and argv[argv.index("--device") + 1] == "cpu"
    # What the user chose is kept.
    argv, _ = complete_argv(["--model-path", "m", "--page-size", "64"], has_cuda=True)
    assert argv.count("--page-size") == 1 and "--device" not in argv
    # A negative control: on GPU nothing CPU-specific is added.
    argv, _ = complete_argv(["--model-path", "m"], has_cuda=True)
    assert "--attention-backend" not in argv and argv[argv.index("--page-size") + 1] == "64"
