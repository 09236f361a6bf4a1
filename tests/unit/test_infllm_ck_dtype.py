"""InfLLM-v2's compressed keys in bfloat16 (``SGLANG_PRR_INFLLM_CK=bf16``) on the CPU: the knob,
the summaries' bytes, the reference update against an fp64 oracle (the float32 mean summed in
position order, rounded to nearest once), the ops' contracts, the scores against the fp64
oracle; the decode step with them is ``test_methods_conformance.py``'s (its ``infllm_v2-bf16``
case). The kernels' bits against this reference are ``tests/gpu/test_infllm_kernels.py``'s."""

from __future__ import annotations

import pytest
import torch

import oracle
from paged import make_paged, rel_err
from sglang_prr import methods, ops
from sglang_prr import reference as ref
from sglang_prr.methods import infllm_v2


@pytest.fixture
def bf16_ck(monkeypatch):
    monkeypatch.setenv(infllm_v2.ENV_CK, "bf16")


@pytest.mark.parametrize("value,dtype", [(None, torch.bfloat16), ("fp32", torch.float32),
                                         ("bf16", torch.bfloat16)])
def test_the_knob_sets_the_layout_and_its_bytes(monkeypatch, value, dtype):
    if value is None:
        monkeypatch.delenv(infllm_v2.ENV_CK, raising=False)
    else:
        monkeypatch.setenv(infllm_v2.ENV_CK, value)
    m = methods.get("infllm_v2")
    (ck,) = m.layout(64, 8, 128)
    assert ck.dtype == dtype
    # 4 keys a page of 64 tokens, 8 heads of 128: 4 KB (fp32) or 2 KB (bf16) a token a layer / 16
    assert m.bytes_per_token(64, 2, 8, 128) == 2 * 4 * 8 * 128 * dtype.itemsize // 64
    k = torch.randn(3, 64, 8, 128)
    assert m.from_keys(k)[0].dtype == dtype
    monkeypatch.setenv(infllm_v2.ENV_CK, "fp16")  # control: refused with its name
    with pytest.raises(ValueError, match="SGLANG_PRR_INFLLM_CK='fp16'"):
        m.layout(64, 8, 128)


def test_reference_update_rounds_the_float32_mean_once(seed):
    """bf16 keys are within half an ulp (plus float32's summation error) of the fp64 mean of the
    window, each one the float32 key rounded to nearest; float32 keys within float32's error."""
    g = torch.Generator().manual_seed(seed)
    page, hk, d, L = 32, 2, 16, 150
    P = make_paged(seed, [L], hk=hk, d=d, page=page)
    P.k_buf.copy_(torch.randn(P.k_buf.shape, generator=g) * 40)  # a wide exponent range
    loc = P.req_to_token[int(P.rows[0]), :L]
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        ck = torch.full((P.k_buf.shape[0] // page, page // 16, hk, d), float("nan"), dtype=dt)
        ref.infllm_update(ck, P.k_buf, P.req_to_token, torch.full((L,), int(P.rows[0])), loc,
                          torch.arange(L), page)
        out[dt] = ck
    n_ck = (L - 32) // 16 + 1
    keys = P.k_buf[loc.long()].double()  # [L, hk, d]
    for i in range(n_ck):
        want = keys[16 * i:16 * i + 32].mean(0)
        last = 16 * i + 31
        pg, j = int(loc[last]) // page, i + 1 - (last // page) * (page // 16)
        f32, b16 = out[torch.float32][pg, j].double(), out[torch.bfloat16][pg, j].double()
        assert ((f32 - want).abs() <= 1e-5 * want.abs() + 1e-4).all(), i
        assert ((b16 - want).abs() <= 2 ** -8 * want.abs() + 1e-4).all(), i
        assert torch.equal(out[torch.bfloat16][pg, j], out[torch.float32][pg, j].bfloat16()), i
    written = ~out[torch.float32].isnan()
    # control: rounded, not the float32 mean
    assert not torch.equal(out[torch.bfloat16][written].float(), out[torch.float32][written])


def test_contracts_take_float32_and_bfloat16_keys_only():
    P = make_paged(3, [100], hk=2, d=16, page=16)
    for dt in (torch.float32, torch.bfloat16):
        ck = torch.zeros(P.k_buf.shape[0] // 16, 1, 2, 16, dtype=dt)
        ops.infllm_update(ck, P.k_buf, P.req_to_token, P.rows[:1], P.req_to_token[2, :1].long(),
                          torch.zeros(1, dtype=torch.long), 16)
        s = ops.infllm_scores(P.q, ck, P.table, P.seq_lens, 16, P.sm_scale)
        assert s.dtype == torch.float32
    ck16 = torch.zeros(P.k_buf.shape[0] // 16, 1, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        ops.infllm_scores(P.q, ck16, P.table, P.seq_lens, 16, P.sm_scale)
    with pytest.raises(ValueError, match="float16"):
        ops.infllm_update(ck16, P.k_buf, P.req_to_token, P.rows[:1],
                          P.req_to_token[2, :1].long(), torch.zeros(1, dtype=torch.long), 16)


def test_scores_from_bf16_keys_match_the_fp64_oracle(bf16_ck, monkeypatch, seed):
    """Within bf16's rounding of the keys (the oracle is written from the keys themselves), the
    same bits as the float32 copy of those keys, and not the float32 keys' scores (control)."""
    m = methods.get("infllm_v2")
    lens, page = [300, 140, 77], 16
    P = make_paged(seed, lens, hk=2, group=4, page=page)
    summary = P.method_summary(m)
    assert summary[0].dtype == torch.bfloat16
    got = m.scores(P.q, summary, table=P.table, seq_lens=P.seq_lens, page_size=page,
                   sm_scale=P.sm_scale)
    want = oracle.infllm_scores(P.q, P.k_buf, P.req_to_token, P.rows, P.seq_lens, page,
                                P.sm_scale)
    for b in range(len(lens)):
        nb = int(P.nblk[b])
        w = torch.tensor(want[b], dtype=torch.float64)
        fin = torch.isfinite(w)
        assert rel_err(got[b, :, :nb].double()[fin], w[fin]) < 2e-2, b
    widened = ops.infllm_scores(P.q, summary[0].float(), P.table, P.seq_lens, page, P.sm_scale)
    assert torch.equal(got, widened)  # bf16 keys are read as their float32 values
    monkeypatch.setenv(infllm_v2.ENV_CK, "fp32")
    exact = m.scores(P.q, P.method_summary(m), table=P.table, seq_lens=P.seq_lens, page_size=page,
                     sm_scale=P.sm_scale)
    assert not torch.equal(got, exact)  # control: rounding the keys moved the scores
