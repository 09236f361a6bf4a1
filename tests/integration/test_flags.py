"""``--prr-*`` flags: generated from PRRConfig, shown in --help, validated with clear errors."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_prr.config import PRRConfig
from sglang_prr.flags import flag_name
from sglang_prr.serving.server_args_patch import complete_argv

REPO = Path(__file__).resolve().parents[2]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _launch(*args, timeout=300, env=None):
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SGLANG_PRR_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "sglang_prr.launch_server", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO))


def test_help_lists_every_prr_flag_next_to_sglang(tmp_path):
    """The first --help imports SGLang for its parser (~15 s); the text is cached, so the next
    one answers in well under a second, the same."""
    env = {"SGLANG_PRR_CACHE": str(tmp_path)}
    p = _launch("--help", env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    for f in dataclasses.fields(PRRConfig):
        assert flag_name(f.name) in p.stdout, f"{flag_name(f.name)} missing from --help"
    assert "--page-size" in p.stdout and "--attention-backend" in p.stdout
    assert "Warning" not in p.stderr, p.stderr[-2000:]  # SGLang's import-time warnings
    t0 = time.monotonic()
    again = _launch("--help", env=env)
    took = time.monotonic() - t0
    assert again.returncode == 0 and again.stdout == p.stdout
    assert took < 3, f"cached --help took {took:.1f} s"
    print(f"--help from the cache: {took:.2f} s")


def test_help_cache_key_follows_what_shapes_the_text(monkeypatch):
    """Negative control for the cache: another terminal width or another SGLang build is
    another key (a stale text is never shown), the same inputs the same key."""
    import importlib.metadata as md

    from sglang_prr.serving import console

    assert console.help_key(80) == console.help_key(80) != console.help_key(120)
    real = md.distribution("sglang")
    fake = type("D", (), {"version": "0.0.0", "locate_file": real.locate_file})()
    before = console.help_key(80)
    monkeypatch.setattr(md, "distribution", lambda name: fake if name == "sglang" else real)
    assert console.help_key(80) != before


@pytest.mark.parametrize("args, needles", [
    (["--prr-top-k", "0"], ["invalid PRR option top_k=0: allowed an integer >= 1"]),
    (["--prr-method", "serial"], ["method='serial'", "use --prr-serial"]),
    (["--prr-method", "infllm-v2"], ["method='infllm-v2'", "did you mean infllm_v2?"]),
    (["--prr-mode", "serial"], ["mode='serial'", "use --prr-serial"]),
    (["--prr-budget", "0"], ["budget=0.0", "use --prr-serial"]),
    (["--prr-topk", "4"], ["unrecognized flag --prr-topk", "did you mean --prr-top-k?"]),
    (["--prr-block-size", "16", "--page-size", "32"], ["--page-size=32"]),
])
def test_bad_prr_flag_fails_in_about_a_second(args, needles):
    """Checked before SGLang (or torch) is imported and before the default model is fetched:
    exit status 2 in under 3 s (it took 9-18 s after the imports), naming the value, with a
    hint where the mistake is a common one."""
    t0 = time.monotonic()
    p = _launch(*args, "--port", "1")  # an SGLang flag beside them is left to SGLang
    took = time.monotonic() - t0
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    for needle in needles:
        assert needle in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert took < 3, f"{args}: exit after {took:.1f} s"


def test_check_prr_argv_passes_good_flags_and_leaves_sglang_flags_alone():
    """Negative control for the test above: valid --prr-* flags among SGLang's (and SGLang's
    abbreviations of its own flags) pass, with their values."""
    from sglang_prr.serving.server_args_patch import check_prr_argv

    cfg = check_prr_argv(["--model-path", "m", "--prr-top-k", "8", "--port", "30001",
                          "--prr-top-k-unit=blocks", "--prr-serial", "--page-size", "64",
                          "--log-level", "info", "--prr-min-cont", "512"])
    assert (cfg.top_k_blocks, cfg.serial, cfg.min_context) == (8, True, 512)
    assert check_prr_argv([]) == PRRConfig().validate()


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
    assert argv[argv.index("--device") + 1] == "cpu"
    # CUDA graphs off under SGLang 0.5.17's names (--disable-cuda-graph is deprecated there).
    assert argv[argv.index("--cuda-graph-backend-decode") + 1] == "disabled"
    assert argv[argv.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert "--disable-cuda-graph" not in argv
    # A CUDA-graph choice of the user's own: the launcher adds none of its graph flags.
    argv, _ = complete_argv(["--model-path", "m", "--disable-cuda-graph"], has_cuda=False)
    assert "--cuda-graph-backend-decode" not in argv and "--cuda-graph-backend-prefill" not in argv
    # What the user chose is kept.
    argv, _ = complete_argv(["--model-path", "m", "--page-size", "64"], has_cuda=True)
    assert argv.count("--page-size") == 1 and "--device" not in argv
    # A negative control: on GPU nothing CPU-specific is added.
    argv, _ = complete_argv(["--model-path", "m"], has_cuda=True)
    assert "--attention-backend" not in argv and argv[argv.index("--page-size") + 1] == "64"


def test_sglang_logs_at_warning_unless_asked(demo_model, monkeypatch):
    """The quiet default: without --log-level SGLang runs at warning (its server_args dump and
    per-batch lines are info); a level given is kept (control)."""
    from sglang_prr.serving import launch_server

    monkeypatch.setenv("SGLANG_PRR_CONFIG", "")  # prepare() exports its config: restore it after
    server_args, _, notes = launch_server.prepare(["--model-path", demo_model])
    assert server_args.log_level == "warning"
    assert not server_args.disable_cuda_graph or _cuda()  # no deprecated flag was added
    server_args, _, _ = launch_server.prepare(["--model-path", demo_model, "--log-level", "info"])
    assert server_args.log_level == "info"


def test_an_abbreviated_block_size_sets_the_page_size_as_it_reads():
    """``--prr-block-siz 16`` is ``--prr-block-size 16`` to both parsers: the page size the
    launcher adds follows it (it used to add the default's 64 and fail on its own flag)."""
    for flag in ("--prr-block-siz", "--prr-block"):
        argv, notes = complete_argv(["--model-path", "m", flag, "16"], has_cuda=True)
        assert argv[argv.index("--page-size") + 1] == "16", argv
    argv, _ = complete_argv(["--model-path", "m", "--prr-meth", "dense"], has_cuda=True)
    assert "--page-size" not in argv  # dense: no page size of PRR's (control)


@pytest.mark.parametrize("given, needle", [
    (dict(serial=True, mode="union"), "--prr-mode union"),
    (dict(serial=True, method="dense"), "--prr-serial"),
    (dict(profile="/some/profile.json"), "--prr-profile is read only with --prr-budget auto"),
    (dict(profile="/some/profile.json", budget=1.0), "this budget is 1.0"),
])
def test_flags_of_which_one_would_be_ignored_are_refused(given, needle):
    from sglang_prr.config import PRRConfigError
    from sglang_prr.serving.server_args_patch import config_from_given

    with pytest.raises(PRRConfigError, match="conflicting PRR options") as e:
        config_from_given(given)
    assert needle in str(e.value)
    # controls: each flag alone is accepted
    for k, v in given.items():
        if k != "profile":
            config_from_given({k: v})
    config_from_given(dict(serial=True, mode="exact"))


def _prepare_exit(argv, capsys):
    from sglang_prr.serving import launch_server

    with pytest.raises(SystemExit) as e:
        launch_server.prepare(argv)
    return e.value.code, capsys.readouterr().err


def test_flags_the_model_decides_fail_before_the_server(demo_model, tmp_path, capsys,
                                                        monkeypatch):
    """Layer ids past the model's layers, a trace path that cannot be a folder, and a profile
    of another layer shape exit 2 with one line from prepare(), before SGLang starts (they
    failed in the scheduler, ~40 s later, with a traceback); the valid ones pass (controls)."""
    import json

    from sglang_prr.serving import launch_server

    monkeypatch.delenv("SGLANG_PRR_CONFIG", raising=False)
    demo_config = json.loads((Path(demo_model) / "config.json").read_text())
    layers = int(demo_config["num_hidden_layers"])
    base = ["--model-path", demo_model, "--prr-block-size", "16", "--prr-top-k", "64",
            "--prr-top-k-unit", "tokens"]
    afile = tmp_path / "a-file"
    afile.write_text("x")
    for extra, needle in (
            (["--prr-dense-layers", str(layers)], f"[0, {layers})"),
            (["--prr-trace-path", str(tmp_path / "t"), "--prr-trace-layers", "0,99"],
             "--prr-trace-layers"),
            (["--prr-trace-path", str(afile)], "--prr-trace-path")):
        code, err = _prepare_exit(base + extra, capsys)
        assert code == 2 and needle in err and "Traceback" not in err, err[-1500:]
    launch_server.prepare(base + ["--prr-dense-layers", str(layers - 1), "--prr-trace-path",
                                  str(tmp_path / "t"), "--prr-trace-layers", "0"])
    assert (tmp_path / "t").is_dir()
    # --prr-budget auto: the profile's layer shape against this model's
    shape = dict(method="quest", num_qo_heads=int(demo_config["num_attention_heads"]),
                 num_kv_heads=int(demo_config["num_key_value_heads"]),
                 head_dim=int(demo_config.get("head_dim") or demo_config["hidden_size"]
                              // demo_config["num_attention_heads"]),
                 page_size=16, top_k_tokens=64)
    rows = [{"batch": 1, "context": 300, "delta": d, "us": 5.0} for d in (0, 1.0)]
    for name, sh, ok in (("same", shape, True), ("heads", dict(shape, num_qo_heads=32), False),
                         ("dim", dict(shape, head_dim="abc"), False)):
        prof = tmp_path / f"{name}.json"
        prof.write_text(json.dumps({"version": 2, "shape": sh, "layer_us": rows}))
        argv = base + ["--prr-budget", "auto", "--prr-profile", str(prof)]
        if ok:
            launch_server.prepare(argv)
        else:
            code, err = _prepare_exit(argv, capsys)
            assert code == 2 and "another layer shape" in err, err[-1500:]


def test_a_bad_sglang_flag_gets_a_short_message(demo_model):
    """A bad value of one of SGLang's own flags: exit 2 with the usage in one line and the
    error (it printed ~490 lines of usage first); --help still lists every flag (control)."""
    p = _launch("--model-path", demo_model, "--max-running-requests", "abc")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "--max-running-requests: invalid int value: 'abc'" in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.splitlines()) < 8, p.stderr[-2000:]
    from sglang_prr.serving import launch_server

    text = launch_server.build_parser().format_help()
    assert "--max-running-requests" in text and "--prr-top-k" in text
