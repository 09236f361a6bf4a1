"""A newcomer's first hour, as CI runs it on a CPU: ``python -m sglang_prr.launch_server`` with
no flags (SmolLM2-135M-Instruct, the default), the README's curl commands sent verbatim, then
Ctrl-C. One server start (~1 min).

The commands are read from the README's fenced block marked ``newcomer-curl`` and run by bash
exactly as written (on port 30000, the README's; only when another process holds that port are
they pointed at a free one). Checks: the chat answer says "Paris" within 30 s; ``/prr/stats``
has every field the README's table lists, and counts no calibration (every prompt here is far
below ``--prr-min-context``) but the short rows it decoded; the log is the quiet default (the
launcher's lines, none of SGLang's info lines or deprecations); Ctrl-C (SIGINT to the process
group, as a terminal sends it) stops every process within 30 s, without a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import psutil
import pytest
from conftest import start_server
from readme import fenced_block, readme_text, shell_commands, table_column

pytestmark = pytest.mark.server

ANSWER_WITHIN_S = 30
STOP_WITHIN_S = 30


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory):
    from sglang_prr.tools import models
    from sglang_prr.serving.harness import README_PORT, free_port

    try:  # converted once per cache (CI does it before the tests); no-op when cached
        models.ensure_smollm2_subprocess()
    except models.ModelUnavailable as e:
        pytest.fail(f"the default model could not be fetched or converted: {e}")
    text = readme_text()
    commands = shell_commands(fenced_block(text, "newcomer-curl"))
    port = README_PORT if _port_free(README_PORT) else free_port()
    if port != README_PORT:  # a dev machine with something on 30000: same commands elsewhere
        print(f"\n[newcomer] port {README_PORT} is taken: the README's commands go to {port}")
        commands = [c.replace(f":{README_PORT}/", f":{port}/") for c in commands]
    # No flags: the default model (not the tests' demo pin), the default log level.
    srv = start_server("newcomer", [], {"SGLANG_PRR_DEFAULT_MODEL": ""}, False, None,
                       tmp_path_factory.mktemp("newcomer"), port=port)
    rec = {"commands": commands, "fields": table_column(text, "prr-stats-fields"), "out": []}
    try:
        t0 = time.monotonic()
        srv.wait_ready()
        rec["start_s"] = time.monotonic() - t0
        for cmd in commands:
            t0 = time.monotonic()
            p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
            rec["out"].append((cmd, p.returncode, p.stdout, time.monotonic() - t0))
        rec["procs"] = [psutil.Process(srv.proc.pid)] + psutil.Process(
            srv.proc.pid).children(recursive=True)
        t0 = time.monotonic()
        os.killpg(srv.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        try:
            rec["rc"] = srv.proc.wait(timeout=STOP_WITHIN_S + 30)
        except subprocess.TimeoutExpired:
            rec["rc"] = None
        rec["stop_s"] = time.monotonic() - t0
        rec["left"] = [p for p in rec["procs"] if _running(p)]
    finally:
        srv.stop()
        for p in rec.get("left", []):
            try:
                p.kill()
            except psutil.Error:
                pass
    rec["log"] = srv.log_path.read_text()
    print(f"\n[newcomer] ready in {rec['start_s']:.0f} s; "
          + ", ".join(f"{c.split()[1].split('/', 3)[-1]} {t:.1f} s" for c, _, _, t in rec["out"])
          + f"; stopped in {rec['stop_s']:.1f} s")
    return rec


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _answer(rec, path):
    hits = [(rc, out, t) for cmd, rc, out, t in rec["out"] if path in cmd]
    assert len(hits) == 1, f"the README's block has {len(hits)} {path} commands"
    rc, out, t = hits[0]
    assert rc == 0, (rc, out[-2000:])
    return json.loads(out), t


def test_readme_block_has_the_four_requests(newcomer):
    cmds = newcomer["commands"]
    assert len(cmds) == 4 and all(c.startswith("curl ") for c in cmds), cmds
    assert [rc for _, rc, _, _ in newcomer["out"]] == [0] * 4


def test_chat_answers_paris_within_30_s(newcomer):
    out, took = _answer(newcomer, "/v1/chat/completions")
    content = out["choices"][0]["message"]["content"]
    print(f"\n[newcomer] chat: {content!r} in {took:.1f} s")
    assert "Paris" in content, out
    assert took < ANSWER_WITHIN_S, f"the chat answer took {took:.1f} s"


def test_generate_and_completions_answer(newcomer):
    gen, _ = _answer(newcomer, "/generate")
    assert gen["meta_info"]["completion_tokens"] > 0 and gen["text"].strip(), gen
    comp, _ = _answer(newcomer, "/v1/completions")
    assert comp["choices"][0]["text"].strip(), comp


def test_prr_stats_has_every_field_the_readme_lists(newcomer):
    stats, _ = _answer(newcomer, "/prr/stats")
    assert len(newcomer["fields"]) > 10, newcomer["fields"]
    missing = [f for f in newcomer["fields"] if f not in stats]
    assert not missing, (missing, stats)
    assert stats["enabled"] is True and stats["config"]["min_context"] == 4096
    # Short prompts only: they decode over every block, so nothing calibrates, and the rows
    # they decoded are counted (dense_rows stayed 0 on such a server before).
    assert stats["calibrations"] == 0 and stats["extend_batches"] > 0, stats
    assert stats["dense_rows"] > 0 and stats["sparse_rows"] == 0, stats


def test_the_log_is_quiet(newcomer):
    log = newcomer["log"]
    for line in ("sglang_prr: serving SmolLM2-135M-Instruct", "sglang_prr: SGLang ",
                 "PRR on: quest", "PRR on. Query it with:"):
        assert line in log, (line, log[-3000:])
    head = log[:log.index("PRR on. Query it with:")]
    # SGLang's info lines (its 14K-character server_args dump, batches, HTTP access lines)
    # and deprecation warnings (the launcher's own flags used to cause one).
    for noise in ("server_args=", "Prefill batch", "Decode batch", "INFO:", "is deprecated and "
                  "will be removed", "UserWarning", "ORJSONResponse is deprecated"):
        assert noise not in log, (noise, log[-3000:])
    assert len(head.splitlines()) < 30, head


def test_ctrl_c_stops_everything_without_a_traceback(newcomer):
    assert newcomer["rc"] == 128 + signal.SIGINT, (newcomer["rc"], newcomer["log"][-3000:])
    assert newcomer["stop_s"] < STOP_WITHIN_S, newcomer["stop_s"]
    assert not newcomer["left"], newcomer["left"]
    for bad in ("Traceback", "KeyboardInterrupt"):
        assert bad not in newcomer["log"], newcomer["log"][-3000:]
