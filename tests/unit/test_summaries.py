"""Block summaries (``sglang_prr.summaries``): the updates of a chunked prefill build what one
update of every token builds (and, for Quest, what ``from_keys`` computes from whole pages), the
byte count the KV pool is sized with is the tensors' size, and an unknown method is a clear
error."""

from __future__ import annotations

import pytest
import torch

from sglang_prr import summaries as S


@pytest.mark.parametrize("method", ["quest", "infllm_v2"])
def test_updates_build_the_summaries_of_whole_pages(method, seed):
    g = torch.Generator().manual_seed(seed)
    L, pages, page, Hk, D = 2, 5, 32, 2, 8
    sm = S.BlockSummaries(method, L, pages, Hk, D, page, torch.device("cpu"))
    k_buf = torch.randn(pages * page, Hk, D, generator=g)
    # One request owning pages 1..4 in shuffled order (page 0: SGLang's padding page).
    order = (torch.randperm(pages - 1, generator=g) + 1).tolist()
    slots = torch.tensor([p * page + t for p in order for t in range(page)])
    req_to_token = torch.zeros(2, slots.numel(), dtype=torch.int32)
    req_to_token[1] = slots.int()
    n = slots.numel()
    for lo, hi in ((0, 40), (40, n)):  # a chunked prefill into layer 1
        loc = slots[lo:hi]
        sm.update(1, k_buf[loc], loc, torch.arange(lo, hi), False, k_buf, req_to_token,
                  lambda lo=lo, hi=hi: torch.full((hi - lo,), 1))
    sm.update(0, k_buf[slots], slots, torch.arange(n), False, k_buf, req_to_token,
              lambda: torch.full((n,), 1))  # all at once into layer 0
    for chunked, bulk in zip(sm.layer(1), sm.layer(0)):
        assert torch.allclose(chunked[order], bulk[order], rtol=1e-6, atol=1e-6)
    fresh = S.BlockSummaries(method, L, pages, Hk, D, page, torch.device("cpu"))
    assert not torch.equal(sm.layer(0)[0], fresh.layer(0)[0])  # control: the updates wrote
    if method == "quest":
        want = S.from_keys(method, k_buf.view(pages, page, Hk, D))
        for got, w in zip(sm.layer(1), want):
            assert torch.allclose(got[order], w[order], rtol=1e-6, atol=1e-6)
    shapes = [tuple(t.shape) for t in S.from_keys(method, k_buf.view(pages, page, Hk, D))]
    assert shapes == [tuple(t.shape) for t in sm.layer(1)]
    per_token = S.bytes_per_token(method, page, L, Hk, D)
    assert per_token * pages * page == sm.nbytes


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown DSA method 'dense'"):
        S.BlockSummaries("dense", 1, 1, 1, 8, 16, torch.device("cpu"))
