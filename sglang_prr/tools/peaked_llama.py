"""A seeded Llama checkpoint whose attention decides the output; a pure-torch forward checks it.

SGLang's ``--load-format dummy`` weights (and default initialisations generally) give near-uniform
attention: over a context of thousands of random tokens the attention output averages to about
zero, below bf16 resolution, so the logprobs do not depend on which blocks are attended and a
sparse decode path that drops blocks still "equals" dense attention. The weights written here
fix that, deterministically from a seed:

* q/k projections give unit-variance-input rows of std ``QK_STD``: attention logits
  ``q.k / sqrt(D)`` of std about ``QK_STD ** 2``, so each query's mass sits on a few dozen keys
  scattered over the whole context (RoPE makes the logits of one token pair vary with distance);
* v/o projections give the attention output a size ``O_STD`` next to the residual stream's
  ``EMBED_STD``: the attended tokens move the hidden state, not a rounding error of it;
* embeddings are independent Gaussians (distinct tokens, distinct rows), the MLP is small, and
  the unembedding gives logits of std about ``LM_HEAD_STD``: a peaked but not saturated softmax.

The scales were chosen by measurement (``python -m sglang_prr.tools.peaked_llama``): on
1.5-4.7K-token prompts, dense decode vs DSA over a few blocks differ by whole units of logprob,
and dense fp32 vs dense bf16 by far less (the numbers are in the README).

``reference_logprobs`` is a plain Llama forward in torch (dense prefill, then teacher-forced
decode steps whose attention goes through ``sglang_prr.reference``: dense, or DSA with Quest
selection of K blocks), so the effect of block selection on logprobs can be checked without a
server.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .. import reference as ref

SEED = 20261
# The shape the GPU server test runs: head dim 128, GQA 4, 4 layers, bf16.
SHAPE = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
             num_hidden_layers=4, intermediate_size=2048, max_position_embeddings=32768)
ROPE_THETA = 10000.0
RMS_EPS = 1e-6
# Standard deviations of the projected values for a unit-RMS input (see the module docstring).
EMBED_STD = 1.0
# q.k/sqrt(D) of std ~2.3 (before RoPE and repeats): each query's mass on a few blocks of a 4K
# context. 2.0 moves the logprobs more but rounds worse in bf16 (dense fp32 vs bf16: 0.063).
QK_STD = 1.5
V_STD = 1.0
O_STD = 1.0  # the attention output as large as the embedding: attention moves the residual
MLP_STD = 0.25  # the MLP is a small perturbation: attention, not the MLP, carries the context
# Logits of std ~3: next-token entropy 3.3-3.6 nats of ln(512) = 6.2; 2.0 is flatter (4.7 nats:
# more near-ties for greedy decoding to part on), 4.0 saturates (12-unit swings, 0.38 bf16 noise).
LM_HEAD_STD = 3.0
TOP_N = 5  # top logprobs per step that the server tests compare


def _normal(gen: torch.Generator, shape: Sequence[int], std: float) -> Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32) * std


def peaked_state_dict(vocab: int, seed: int = SEED, qk_std: float = QK_STD,
                      o_std: float = O_STD, lm_head_std: float = LM_HEAD_STD,
                      **shape) -> Dict[str, Tensor]:
    """The HF Llama state dict (float32) of the recipe above, for ``SHAPE`` updated by
    ``shape``. A projection from width ``n`` has entries of std ``target / sqrt(n)``, so an input
    of unit RMS gives outputs of std ``target``."""
    s = dict(SHAPE, **shape)
    h, d, L = s["hidden_size"], s["head_dim"], s["num_hidden_layers"]
    hq, hk, ff = s["num_attention_heads"] * d, s["num_key_value_heads"] * d, s["intermediate_size"]
    gen = torch.Generator().manual_seed(int(seed))
    sd = {"model.embed_tokens.weight": _normal(gen, (vocab, h), EMBED_STD)}
    for i in range(L):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = _normal(gen, (hq, h), qk_std / math.sqrt(h))
        sd[p + "self_attn.k_proj.weight"] = _normal(gen, (hk, h), qk_std / math.sqrt(h))
        sd[p + "self_attn.v_proj.weight"] = _normal(gen, (hk, h), V_STD / math.sqrt(h))
        sd[p + "self_attn.o_proj.weight"] = _normal(gen, (h, hq), o_std / math.sqrt(hq))
        sd[p + "mlp.gate_proj.weight"] = _normal(gen, (ff, h), 1.0 / math.sqrt(h))
        sd[p + "mlp.up_proj.weight"] = _normal(gen, (ff, h), 1.0 / math.sqrt(h))
        sd[p + "mlp.down_proj.weight"] = _normal(gen, (h, ff), MLP_STD / math.sqrt(ff))
        sd[p + "input_layernorm.weight"] = torch.ones(h)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h)
    sd["model.norm.weight"] = torch.ones(h)
    sd["lm_head.weight"] = _normal(gen, (vocab, h), lm_head_std / math.sqrt(h))
    return sd


def write_peaked_model(out: Path, seed: int = SEED, qk_std: float = QK_STD, o_std: float = O_STD,
                       lm_head_std: float = LM_HEAD_STD, **shape) -> str:
    """Write a bf16 safetensors Llama checkpoint of the recipe above, its ``config.json`` and the
    demo's offline tokenizer into ``out``; returns the folder (for ``--model-path``). About 71 MB
    at ``SHAPE``; a few seconds on a CPU."""
    from safetensors.torch import save_file

    from .demo import shaped_model_dir

    # The demo's tokenizer and a config.json of this shape (demo.shaped_model_dir), then weights.
    path = shaped_model_dir(
        Path(out), **{**SHAPE, **shape}, dtype="bfloat16", torch_dtype="bfloat16",
        tie_word_embeddings=False, rms_norm_eps=RMS_EPS, rope_theta=ROPE_THETA,
        rope_parameters={"rope_theta": ROPE_THETA, "rope_type": "default"})
    cfg = json.loads((Path(path) / "config.json").read_text())
    sd = peaked_state_dict(cfg["vocab_size"], seed, qk_std, o_std, lm_head_std, **shape)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()},
              str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_model(path: str) -> tuple:
    """``(config dict, float32 state dict)`` of a folder written by ``write_peaked_model``."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(path) / "config.json").read_text())
    sd = {k: v.float() for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
    return cfg, sd


# ----------------------------------------------------------------------------- reference forward
def _rms(x: Tensor, w: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype) * w


def _rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """HF Llama's rotate-half RoPE. x: ``[T, H, D]``; pos: ``[T]``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = pos.float().unsqueeze(-1) * inv  # [T, D/2]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2:]
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def reference_logprobs(cfg: Dict, sd: Dict[str, Tensor], ids: List[int], cont: List[int],
                       top_k_blocks: Sequence[Optional[int]], page_size: int = 64, sink: int = 1,
                       local: int = 1, dtype: torch.dtype = torch.float32) -> Tensor:
    """Log-softmax of the next-token logits at the prompt's end and after each of ``cont``, for
    each decode attention of ``top_k_blocks``.

    Prefill of ``ids`` is dense (as in the server) and shared; each token of ``cont`` is then
    decoded one at a time (teacher-forced, so every mode sees the same contexts) with decode
    attention dense (an entry ``None``) or serial DSA: Quest selection of that many middle
    blocks plus ``sink``/``local`` kept blocks, every layer. ``dtype`` is the activation and
    weight dtype (attention itself is float32, as in the server's kernels). Returns
    ``[len(top_k_blocks), 1 + len(cont), vocab]`` float32 (row 0 of each mode is the prefill's).
    """
    w = {k: v.to(dtype) for k, v in sd.items()}
    L, hq, hk = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["head_dim"]
    theta = float(cfg.get("rope_theta", ROPE_THETA))
    scale = 1.0 / math.sqrt(d)
    n_all = len(ids) + len(cont)
    nb = -(-n_all // page_size)
    # Paged KV as the server lays it out: block j in page j + 1 (page 0 is SGLang's padding).
    slots = (nb + 1) * page_size
    table = torch.arange(1, nb + 1).unsqueeze(0)  # [1, NB]
    kv = [(torch.zeros(slots, hk, d, dtype=dtype), torch.zeros(slots, hk, d, dtype=dtype))
          for _ in range(L)]
    summ = [(torch.full((nb + 1, hk, d), float("inf")), torch.full((nb + 1, hk, d), -math.inf))
            for _ in range(L)]

    def layer_qkv(i, x, pos):
        p = f"model.layers.{i}.self_attn."
        hn = _rms(x, w[f"model.layers.{i}.input_layernorm.weight"])
        q = _rope((hn @ w[p + "q_proj.weight"].T).view(-1, hq, d), pos, theta)
        k = _rope((hn @ w[p + "k_proj.weight"].T).view(-1, hk, d), pos, theta)
        v = (hn @ w[p + "v_proj.weight"].T).view(-1, hk, d)
        loc = pos + page_size  # slot of position t: page t // P + 1
        kv[i][0][loc], kv[i][1][loc] = k, v
        ref.quest_update(summ[i][0], summ[i][1], k, loc, pos, page_size)
        return q, k, v

    def finish(i, x, o):
        p = f"model.layers.{i}."
        x = x + o.to(dtype).reshape(x.shape[0], hq * d) @ w[p + "self_attn.o_proj.weight"].T
        hn = _rms(x, w[p + "post_attention_layernorm.weight"])
        g = torch.nn.functional.silu(hn @ w[p + "mlp.gate_proj.weight"].T)
        return x + (g * (hn @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T

    def head(x):
        lg = _rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T
        return torch.log_softmax(lg.float(), -1)

    emb = w["model.embed_tokens.weight"]
    pos = torch.arange(len(ids))
    x = emb[torch.tensor(ids)]
    for i in range(L):
        q, k, v = layer_qkv(i, x, pos)
        g = hq // hk
        o = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1), k.float().repeat_interleave(g, 1).transpose(0, 1),
            v.float().repeat_interleave(g, 1).transpose(0, 1), is_causal=True, scale=scale)
        x = finish(i, x, o.transpose(0, 1))
    first = head(x[-1:])[0]
    prefilled = [(k.clone(), v.clone()) for k, v in kv], [(a.clone(), b.clone()) for a, b in summ]
    modes = []
    for k_blocks in top_k_blocks:
        # Each mode decodes from the prefill's cache: its own decode keys differ from layer 1 on.
        kv[:] = [(k.clone(), v.clone()) for k, v in prefilled[0]]
        summ[:] = [(a.clone(), b.clone()) for a, b in prefilled[1]]
        out = [first]
        for t, tok in enumerate(cont):
            n = len(ids) + t + 1  # tokens in the context, the new one included
            pos = torch.tensor([n - 1])
            seq_lens = torch.tensor([n])
            x = emb[torch.tensor([tok])]
            for i in range(L):
                q, _, _ = layer_qkv(i, x, pos)
                if k_blocks is None:
                    o = ref.dense_attention(q, kv[i][0], kv[i][1], table, seq_lens, page_size,
                                            scale)
                else:  # serial Quest DSA on the reference: scores, A, attention over A
                    nblk = ref.num_blocks(seq_lens, page_size)
                    a = ref.select_topk(ref.quest_scores(q, *summ[i], table, nblk), nblk,
                                        k_blocks, sink, local)
                    o = ref.attend_set(q, kv[i][0], kv[i][1], table, seq_lens, *a, page_size,
                                       scale)[0]
                x = finish(i, x, o)
            out.append(head(x)[0])
        modes.append(torch.stack(out))
    return torch.stack(modes)


def _main() -> None:
    """Measure the recipe: dense vs DSA at a few K, and fp32 vs bf16 dense (the noise floor)."""
    import argparse
    import random
    import tempfile
    import time

    ap = argparse.ArgumentParser(description=_main.__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1500, 3100])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--qk-std", type=float, default=QK_STD)
    ap.add_argument("--o-std", type=float, default=O_STD)
    ap.add_argument("--lm-head-std", type=float, default=LM_HEAD_STD)
    ap.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    a = ap.parse_args()
    print(f"prompt seed {a.seed}, qk_std {a.qk_std}, o_std {a.o_std}, "
          f"lm_head_std {a.lm_head_std}")
    with tempfile.TemporaryDirectory() as tmp:
        cfg, sd = load_model(write_peaked_model(Path(tmp), qk_std=a.qk_std, o_std=a.o_std,
                                                 lm_head_std=a.lm_head_std))
    rng = random.Random(a.seed)
    for n in a.lengths:
        ids = [rng.randrange(6, cfg["vocab_size"]) for _ in range(n)]
        cont = [rng.randrange(6, cfg["vocab_size"]) for _ in range(a.steps)]
        t0 = time.time()
        lp = reference_logprobs(cfg, sd, ids, cont, [None] + a.ks)[:, 1:]
        dense = lp[0]
        t1 = time.time()
        bf16 = reference_logprobs(cfg, sd, ids, cont, [None], dtype=torch.bfloat16)[0, 1:]
        top = dense.topk(TOP_N, -1).indices  # [steps, TOP_N]: the logprobs the tests compare

        def diff(x):
            return (dense - x).gather(-1, top).abs().amax(-1)

        ent = -(dense.exp() * dense).sum(-1).mean().item()  # host-ok: CLI measurement
        print(f"len {n} ({-(-n // 64)} blocks): entropy {ent:.2f} nats, top-{TOP_N} "
              f"max|dense fp32 - dense bf16| {diff(bf16).max():.3f} "
              f"({t1 - t0:.0f} s fp32, all K; {time.time() - t1:.0f} s bf16)")
        for k, sp in zip(a.ks, lp[1:]):
            dd = diff(sp)
            print(f"  K={k}: top-{TOP_N} max|dense - DSA| per step "
                  f"{[round(v, 3) for v in dd.tolist()]}")  # host-ok: CLI measurement


if __name__ == "__main__":
    _main()
