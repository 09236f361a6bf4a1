"""InfLLM-v2's compressed keys in bfloat16 (``SGLANG_PRR_INFLLM_CK=bf16``) on the CPU: the knob,
the summaries' bytes, the reference update against an fp64 oracle (the float32 mean summed in
position order, rounded to nearest once), the ops' contracts, the scores against the fp64
oracle, and the decode step (PRR exact equals serial DSA over the method's own selection). The
kernels' bits against this reference are ``tests/gpu/test_infllm_kernels.py``'s."""

from __future__ import annotations

import pytest
import torch

import oracle
from paged import make_paged, rel_err
from sglang_prr import contracts, methods, ops
from sglang_prr import reference as ref
from sglang_prr.methods import infllm_v2
from sglang_prr.step import DecodeStep, new_layer_state

CPU = torch.device("cpu")


@pytest.fixture
def bf16_ck(monkeypatch):
    monkeypatch.setenv(infllm_v2.ENV_CK, "bf16")


def _summarise(m, P):
    tensors = m.allocate(1, P.k_buf.shape[0] // P.page, P.k_buf.shape[1], P.k_buf.shape[2],
                         P.page, CPU)
    summary = [t[0] for t in tensors]
    for b in range(len(P.seq_lens)):
        L = int(P.seq_lens[b])
        loc = P.req_to_token[int(P.rows[b]), :L]
        m.update(summary, P.k_buf[loc.long()], loc, torch.arange(L), P.page, decode=False,
                 key_buffer=P.k_buf, req_to_token=P.req_to_token,
                 token_req_idx=lambda b=b, L=L: torch.full((L,), int(P.rows[b])))
    return summary


@pytest.mark.parametrize("value,dtype", [(None, torch.float32), ("fp32", torch.float32),
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
    summary = _summarise(m, P)
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
    exact = m.scores(P.q, _summarise(m, P), table=P.table, seq_lens=P.seq_lens, page_size=page,
                     sm_scale=P.sm_scale)
    assert not torch.equal(got, exact)  # control: rounding the keys moved the scores


def test_decode_step_with_bf16_keys_equals_serial_dsa(bf16_ck, seed):
    m = methods.get("infllm_v2")
    lens = [200, 97, 150]
    P = make_paged(seed, lens, hk=2, group=4, page=16)
    summary = _summarise(m, P)
    R, hk, nb = P.req_to_token.shape[0], 2, P.nb
    g = torch.Generator().manual_seed(seed + 1)
    prr, serial = (DecodeStep("infllm_v2", 2, 3, 1, 1, 16, 0, exact=True, serial=s, device=CPU)
                   for s in (False, True))
    st = new_layer_state(R, hk, nb, 3 + 2, (0.5, 0.3, 0.4), CPU)
    for t in range(4):
        seq = torch.tensor([L - 6 + t for L in lens])
        q = P.q + 3 * torch.randn(P.q.shape, generator=g)
        stats = contracts.new_stats()
        o = prr.run(q, P.k_buf, P.v_buf, summary, prr.plan(P.req_to_token, P.rows, seq), st,
                    stats, P.sm_scale, torch.float32)
        bs = serial.plan(P.req_to_token, P.rows, seq)
        o_serial = serial.run(q, P.k_buf, P.v_buf, summary, bs, None, None, P.sm_scale,
                              torch.float32)
        assert rel_err(o, o_serial) < 1e-5, t
        dense = ref.dense_attention(q, P.k_buf, P.v_buf, bs.table, seq, 16, P.sm_scale)
        assert rel_err(dense, o_serial) > 1e-2, t  # control: the selection matters
