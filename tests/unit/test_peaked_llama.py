"""The GPU server test's weights make block selection visible in the logprobs (CPU, no server).

``tools.peaked_llama`` writes the checkpoint that ``tests/gpu/test_server_gpu.py`` serves;
its controls (DSA at small K != dense) hold only if attention decides the output. Checked here
with the pure-torch forward on the written file: DSA at K = 2 blocks moves the top logprobs by
far more than the GPU test's threshold, K covering every block equals dense, and (the check's
own negative control) weights at the scale of SGLang's dummy init do not move them.
"""

from __future__ import annotations

import random

import torch

from sglang_prr.tools import peaked_llama as pl

LENGTH = 1100  # 18 blocks of 64 (not a multiple of the block)
DIFFERENT = 0.5  # the GPU test's threshold for "differs"


def _top_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference over the top-5 logprobs of ``a`` (what the server tests compare)."""
    top = a.topk(5, -1).indices
    return (a - b).gather(-1, top).abs().max().item()


def test_written_weights_make_small_k_differ_from_dense(tmp_path, seed):
    cfg, sd = pl.load_model(pl.write_peaked_model(tmp_path / "m"))
    assert cfg["torch_dtype"] == "bfloat16" and cfg["head_dim"] == 128, cfg
    rng = random.Random(seed)
    ids = [rng.randrange(6, cfg["vocab_size"]) for _ in range(LENGTH)]
    # Four decode steps, the largest difference over them (as the GPU server test takes over
    # its steps): one step alone came within 10% of the threshold on some prompts.
    cont = [rng.randrange(6, cfg["vocab_size"]) for _ in range(4)]
    dense, small, full = pl.reference_logprobs(cfg, sd, ids, cont,
                                               [None, 2, -(-(LENGTH + 1) // 64)])[:, 1:]
    d_small, d_full = _top_diff(dense, small), _top_diff(dense, full)
    print(f"seed {seed}: top-5 |dense - DSA(K=2)| {d_small:.3f}, |dense - DSA(K=all)| {d_full:.2e}")
    assert d_small > DIFFERENT, f"DSA at K=2 of 18 blocks moved logprobs by only {d_small}"
    assert d_full < 1e-4, f"DSA over every block differs from dense by {d_full}"


def test_dummy_style_init_hides_the_choice_of_blocks(seed):
    """Negative control: at the scale of SGLang's dummy weights (uniform(-1e-3, 1e-3): rows of
    std 0.018 at width 1024) on q/k and v/o, the same measurement cannot tell K = 2 from dense,
    which is why the dummy-weight server test proved nothing."""
    cfg = dict(pl.SHAPE, vocab_size=512, rope_theta=pl.ROPE_THETA)
    sd = pl.peaked_state_dict(512, qk_std=0.018, o_std=0.018)
    rng = random.Random(seed)
    ids = [rng.randrange(6, 512) for _ in range(LENGTH)]
    cont = [rng.randrange(6, 512)]
    d = _top_diff(*pl.reference_logprobs(cfg, sd, ids, cont, [None, 2])[:, 1:])
    print(f"seed {seed}: dummy-style init, top-5 |dense - DSA(K=2)| {d:.2e}")
    # fp32 here; far below a bf16 step of a logprob near -6 (0.03): no witness of attention
    assert d < DIFFERENT / 10, f"dummy-style init: K=2 vs dense moved logprobs by {d}"
