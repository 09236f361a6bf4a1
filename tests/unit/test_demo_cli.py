"""``python -m sglang_prr`` (the ops demo): a real ``--help`` (every option described, with its
default, under the command's own name) and a header that explains the printed columns."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from sglang_prr import __main__ as demo

REPO = Path(__file__).resolve().parents[2]


def _run(*args, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "sglang_prr", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=str(REPO))


def undescribed(parser: argparse.ArgumentParser):
    return [a.option_strings[0] for a in parser._actions
            if a.option_strings and a.option_strings[0] != "-h" and not a.help]


def test_help_describes_every_option_with_its_default():
    p = _run("--help")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("usage: python -m sglang_prr "), p.stdout[:200]
    assert "__main__" not in p.stdout
    assert undescribed(demo.build_parser()) == []
    for action in demo.build_parser()._actions:
        if action.option_strings and action.default is not argparse.SUPPRESS:
            assert action.option_strings[0] in p.stdout
    assert p.stdout.count("(default:") == len(demo.build_parser()._actions) - 1  # all but -h


def test_an_undescribed_option_is_caught():
    """Negative control for the check above."""
    parser = demo.build_parser()
    parser.add_argument("--bare", type=int, default=1)
    assert undescribed(parser) == ["--bare"]


def test_small_run_prints_the_header_and_one_row_per_step():
    p = _run("--context", "512", "--steps", "2", "--batch", "1", "--block-size", "16",
             "--top-k", "64", "--device", "cpu")
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert p.stdout.startswith(demo.HEADER)
    for column in ("step", "hit(|P&A|/|A|)", "|M|(mean)", "max|PRR-DSA|"):
        assert f"  {column}" in demo.HEADER, column  # each column is explained
    head = lines.index("step  hit(|P&A|/|A|)  |M|(mean)  max|PRR-DSA|")
    rows = [l.split() for l in lines[head + 1:]]
    assert [int(r[0]) for r in rows] == [0, 1]
    assert all(0.0 <= float(r[1]) <= 1.0 and float(r[3]) < 1e-4 for r in rows), rows
