"""The built-in demo model: a tiny Llama-shaped model and a BPE tokenizer, created offline.

``python -m sglang_prr.launch_server --model-path demo-tiny`` serves it, and so does the launcher
without ``--model-path`` when its default real model (``models``) cannot be fetched:
it needs no download. The weights are random (seeded), with the
q/k projections scaled up so attention is peaked and long-range: a few blocks dominate each query,
which makes the choice of blocks visible in the output (dense attention and DSA at a small K give
different logprobs). It is a test and demo vehicle, not a language model.

The files are written once to ``$SGLANG_PRR_CACHE`` (default ``~/.cache/sglang_prr``) under a
versioned folder, built in a temporary folder and renamed into place so that concurrent callers
never see a half-written model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# Bump when the recipe below changes, so stale caches are not reused.
DEMO_VERSION = 1
DEMO_NAME = f"prr-demo-llama-v{DEMO_VERSION}"

# Shape: 2 layers, 4 query heads over 2 KV heads (GQA 2), head_dim 32. Small enough that a CPU
# server starts in seconds, large enough to exercise GQA and several layers.
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 256
VOCAB = 512
MAX_POSITIONS = 8192
SEED = 1234
# Each of q_proj/k_proj is multiplied by this, so logits grow by its square: attention becomes
# peaked (a handful of keys carry most of the mass) instead of the near-uniform attention of a
# default-initialised model.
QK_SCALE = 6.0

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three attention sparse block query key "
    "value cache predict reuse repair decode prefill token server model request batch page"
).split()


def cache_root() -> Path:
    return Path(os.environ.get("SGLANG_PRR_CACHE", Path.home() / ".cache" / "sglang_prr"))


def demo_model_path() -> str:
    """Path of the demo model folder, created on first use."""
    path = cache_root() / DEMO_NAME
    if not (path / "done").exists():
        _build(path)
    return str(path)


def _corpus():
    import random

    rng = random.Random(SEED)
    for _ in range(2000):
        n = rng.randint(5, 20)
        yield " ".join(rng.choice(_CORPUS_WORDS) for _ in range(n)) + "."


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>")
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _build_model(out: Path, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                      max_position_embeddings=MAX_POSITIONS, rope_theta=10000.0,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
                      torch_dtype="float32")
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # a wider init than HF's 0.02 gives less flat logits
            p.normal_(0.0, 0.08) if p.dim() == 2 else None
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)
    model.to(torch.float32).save_pretrained(str(out), safe_serialization=True)


def _build(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=DEMO_NAME + ".", dir=str(path.parent)))
    try:
        _build_tokenizer(tmp)
        vocab = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
        _build_model(tmp, max(vocab, 8))
        (tmp / "done").write_text("ok\n")
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race: keep theirs
            if not (path / "done").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def shaped_model_dir(out: Path, **config) -> str:
    """A model folder with the demo's offline tokenizer and a Llama ``config.json`` of another
    shape (``config`` overrides the demo's, e.g. ``num_hidden_layers=32``), for SGLang's
    ``--load-format dummy`` (random weights: no checkpoint is written). Shapes PRR must be timed or
    tested on, without a model hub."""
    src = Path(demo_model_path())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


if __name__ == "__main__":
    print(demo_model_path())
