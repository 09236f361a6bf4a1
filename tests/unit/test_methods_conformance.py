"""Every registered DSA method (``sglang_prr.methods``) through the same checks, on the CPU:

* the bytes the KV pool gives up (``bytes_per_token``) are the allocated tensors' bytes, in the
  layout's shapes and dtypes (``from_keys`` too);
* the updates of a chunked prefill followed by decode tokens build what one update of every
  token builds, and a reused page forgets its previous owner;
* the scores against an fp64 oracle written from the keys, and the selection (A = kept + top-K,
  ``M = A \\ P``, dense rows, pool rows of P, the counters) against a scalar oracle over them;
  ``select_predict`` equals ``select`` then the predictor's step;
* ``step.DecodeStep``: serial DSA equals attention over the method's own A, PRR (exact) equals
  serial DSA step after step, and DSA at small K differs from dense attention (control);
* everything runs on the meta device: no host read of a tensor value (graph safety).

The toy method of ``toy_method.py`` (block-mean keys, reference path only) is registered here,
from outside the package, and passes the same checks: adding a method touches no other file.
The kernels of the methods that have them are compared with their reference in
``tests/gpu/test_methods_conformance.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

import oracle
import toy_method
from paged import make_paged, rel_err
from sglang_prr import config, contracts, methods
from sglang_prr import reference as ref
from sglang_prr.methods import SelectSpec, infllm_v2
from sglang_prr.step import DecodeStep, new_layer_state

TOY = methods.register(toy_method.BlockMean())
F32_TOL = 2e-5
# fp64 oracle of each method's scores (from the keys, without the summaries), and its tolerance:
# Quest's summaries are bf16 rounded outward (~2^-8 relative per bound).
ORACLES = {
    "quest": (lambda P: oracle.quest_scores(P.q, P.k_buf, P.req_to_token, P.rows, P.seq_lens,
                                            P.page), 1e-2),
    "infllm_v2": (lambda P: oracle.infllm_scores(P.q, P.k_buf, P.req_to_token, P.rows,
                                                 P.seq_lens, P.page, P.sm_scale), F32_TOL),
    TOY.name: (lambda P: toy_method.oracle_scores(P.q, P.k_buf, P.req_to_token, P.rows,
                                                  P.seq_lens, P.page, P.sm_scale), F32_TOL),
}
CPU = torch.device("cpu")
K, N_PRED, SINK, LOCAL = 2, 3, 1, 1

every_method = pytest.mark.parametrize("name", methods.names())
# every method with its default summaries, and InfLLM-v2 with its compressed keys in float32 too
every_layout = pytest.mark.parametrize("name,keys", [(n, None) for n in methods.names()] +
                                       [("infllm_v2", "fp32")])
BF16_TOL = 2e-2  # summaries rounded to bfloat16 (8 significant bits) against the fp64 oracle


def test_registry_agrees_with_config():
    """The built-in methods are ``--prr-method``'s choices but ``dense`` (PRR off), the toy
    registered here joins them, and an unknown name is a clear error."""
    assert methods.BUILTIN and set(methods.BUILTIN) == set(config.METHODS) - {"dense"}
    assert TOY.name in methods.names() and TOY.name not in methods.BUILTIN
    assert all(methods.get(n).name == n for n in methods.names())
    with pytest.raises(ValueError, match="unknown DSA method 'dense'"):
        methods.get("dense")  # control: config's extra choice is no DSA method
    with pytest.raises(ValueError, match="already"):
        methods.register(type("Other", (toy_method.BlockMean,), {})())
    with pytest.raises(ValueError, match="built-in"):
        methods.unregister("quest")


# ----------------------------------------------------------------------------- summaries
@every_method
@pytest.mark.parametrize("page,hk,d,layers", [(16, 2, 8, 2), (32, 3, 16, 5), (64, 1, 24, 3)])
def test_summary_bytes_match_the_allocated_tensors(name, page, hk, d, layers):
    m = methods.get(name)
    pages = 7
    lay = m.layout(page, hk, d)
    tensors = m.allocate(layers, pages, hk, d, page, CPU)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == [
        ((layers, pages) + tuple(s.per_page), s.dtype) for s in lay]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    per_token = m.bytes_per_token(page, layers, hk, d)
    # Rounded up per token: exact when the bytes of a page divide by its tokens.
    assert per_token * pages * page >= nbytes > (per_token - 1) * pages * page
    assert m.bytes_per_token(page, layers + 1, hk, d) > per_token  # control: it counts layers
    keys = torch.randn(pages, page, hk, d)
    assert [(tuple(t.shape), t.dtype) for t in m.from_keys(keys)] == [
        ((pages,) + tuple(s.per_page), s.dtype) for s in lay]


@every_method
def test_chunked_prefill_and_decode_updates_equal_one_update(name, seed):
    """A chunked prefill and decode tokens build what one update of every token builds, and a
    reused page forgets its previous owner (as far as the scores read it)."""
    m = methods.get(name)
    g = torch.Generator().manual_seed(seed)
    pages, page, hk, d = 6, 32, 2, 8
    k_buf = torch.randn(pages * page, hk, d, generator=g)
    k_old = torch.randn(pages * page, hk, d, generator=g) * 3  # a previous owner's keys
    # One request in slot 1 owning pages 1..5 in shuffled order (page 0: SGLang's padding page).
    order = (torch.randperm(pages - 1, generator=g) + 1).tolist()
    slots = torch.tensor([p * page + t for p in order for t in range(page)])
    r2t = torch.zeros(2, slots.numel(), dtype=torch.int32)
    r2t[1] = slots.int()
    n = slots.numel() - 5
    tensors = m.allocate(3, pages, hk, d, page, CPU)

    def update(layer, lo, hi, decode, keys=k_buf):
        loc = slots[lo:hi]
        m.update([t[layer] for t in tensors], keys[loc], loc, torch.arange(lo, hi), page,
                 decode=decode, key_buffer=keys, req_to_token=r2t,
                 token_req_idx=lambda: torch.full((hi - lo,), 1))

    update(0, 0, n, False)  # every token at once into layer 0
    cut = random.Random(seed).randrange(1, n - 4)
    update(1, 0, cut, False)  # a chunked prefill into layer 1 ...
    update(1, cut, n - 3, False)
    for t in range(n - 3, n):  # ... and its last tokens as decode steps
        update(1, t, t + 1, True)
    update(2, 0, slots.numel(), False, k_old)  # layer 2: the pages' previous owner, then ours
    prev = [t[2].clone() for t in tensors]
    update(2, 0, n, False)
    mine = torch.tensor(order)
    for one, chunked in zip([t[0] for t in tensors], [t[1] for t in tensors]):
        torch.testing.assert_close(chunked[mine], one[mine], rtol=1e-6, atol=1e-5,
                                   equal_nan=True)
    fresh = m.allocate(3, pages, hk, d, page, CPU)
    assert any(not torch.equal(t[0][mine], f[0][mine]) for t, f in zip(tensors, fresh)), \
        "control: the updates wrote nothing"
    q = torch.randn(1, 2 * hk, d, generator=g) * 3
    args = dict(table=mine.view(1, -1), seq_lens=torch.tensor([n]), page_size=page,
                sm_scale=d ** -0.5)
    s = [m.scores(q, [t[i] for t in tensors], **args) for i in (0, 2)]
    torch.testing.assert_close(s[1], s[0], rtol=1e-5, atol=1e-5, equal_nan=True)
    # Control: the previous owner's summaries score otherwise (there was something to forget).
    assert not torch.allclose(m.scores(q, prev, **args), s[0], rtol=1e-3, equal_nan=True)


# ----------------------------------------------------------------------------- scores, selection
@every_layout
@pytest.mark.parametrize("lens,group,page", [([150, 97, 61], 4, 16), ([300, 45], 1, 32),
                                             ([129, 200, 77, 96], 8, 64)])
def test_scores_match_the_fp64_oracle(name, keys, seed, lens, group, page, monkeypatch):
    if keys is not None:
        monkeypatch.setenv(infllm_v2.ENV_CK, keys)
    m = methods.get(name)
    assert name in ORACLES, f"no fp64 oracle for the DSA method {name!r}: add one to ORACLES"
    fn, tol = ORACLES[name]
    P = make_paged(seed, lens, hk=2, group=group, page=page)
    summary = P.method_summary(m)
    if any(t.dtype == torch.bfloat16 for t in summary):
        tol = max(tol, BF16_TOL)
    got = m.scores(P.q, summary, table=P.table, seq_lens=P.seq_lens, page_size=page,
                   sm_scale=P.sm_scale)
    assert got.shape == (len(lens), 2, P.nb) and got.dtype == torch.float32
    want = fn(P)
    other = fn(make_paged(seed + 1, lens, hk=2, group=group, page=page))
    mine, theirs = [], []
    for b in range(len(lens)):
        nb = int(P.nblk[b])
        w = torch.tensor(want[b], dtype=torch.float64)
        gb = got[b, :, :nb].double()
        assert torch.equal(torch.isinf(gb), torch.isinf(w)), b
        fin = torch.isfinite(w)
        assert rel_err(gb[fin], w[fin]) < tol, b
        assert torch.isneginf(got[b, :, nb:]).all(), "blocks past the request score -inf"
        mine.append(gb[fin])
        theirs.append(torch.tensor(other[b], dtype=torch.float64)[fin])
    # Control: the oracle of other keys and queries is far from these scores.
    assert not rel_err(torch.cat(mine), torch.cat(theirs)) < tol


def _pool_p(B, hk, nblk, rnd, width, R):
    """Pool-wide P ``[R, Hk, width]`` (garbage in other rows), the batch's rows, its sets."""
    p_idx = torch.randint(0, 5, (R, hk, width), dtype=torch.int32)
    p_cnt = torch.randint(0, width + 1, (R, hk), dtype=torch.int32)
    rows = torch.tensor(rnd.sample(range(R), B))
    sets = []
    for b in range(B):
        per_head = []
        for h in range(hk):
            s = sorted(rnd.sample(range(int(nblk[b])), rnd.randint(0, min(width, int(nblk[b])))))
            p_idx[rows[b], h] = torch.tensor(s + [-1] * (width - len(s)), dtype=torch.int32)
            p_cnt[rows[b], h] = len(s)
            per_head.append(set(s))
        sets.append(per_head)
    return p_idx, p_cnt, rows, sets


@every_method
def test_selection_matches_the_oracle_with_pool_rows_dense_rows_and_counters(name, seed):
    m = methods.get(name)
    rnd = random.Random(seed)
    lens = [rnd.randint(6 * 16, 14 * 16) for _ in range(4)]
    lens[1] = rnd.randint(3 * 16, 6 * 16)  # the dense row: short, all of it fits in n_out
    P = make_paged(seed, lens, hk=2, group=4, page=16)
    summary = P.method_summary(m)
    B, hk = len(lens), 2
    spec = SelectSpec.of(K, SINK, LOCAL, 16, n_out=K + SINK + LOCAL + 2)
    dense = torch.tensor([False, True, False, False])
    p_idx, p_cnt, p_rows, p_sets = _pool_p(B, hk, P.nblk, rnd, 5, 11)
    stats = contracts.new_stats()
    sel = m.select(P.q, summary, table=P.table, seq_lens=P.seq_lens, spec=spec,
                   sm_scale=P.sm_scale, p_idx=p_idx, p_cnt=p_cnt, p_rows=p_rows,
                   dense_row=dense, stats=stats)
    scores = m.scores(P.q, summary, table=P.table, seq_lens=P.seq_lens, page_size=16,
                      sm_scale=P.sm_scale)
    torch.testing.assert_close(sel.scores, scores, rtol=0, atol=0, equal_nan=True)
    want = [0, 0, 0, 0]
    for b in range(B):
        nb = int(P.nblk[b])
        for h in range(hk):
            row = [float(x) for x in scores[b, h, :nb]]
            a = set(range(nb)) if dense[b] else oracle.topk_set(row, nb, K, SINK, LOCAL)
            for idx, cnt, s in ((sel.a_idx, sel.a_cnt, a), (sel.m_idx, sel.m_cnt,
                                                             a - p_sets[b][h])):
                n = int(cnt[b, h])
                assert idx[b, h, :n].tolist() == sorted(s), (b, h)
                assert (idx[b, h, n:] == -1).all()
            if not dense[b]:
                want = [want[0] + len(a), want[1] + len(a - p_sets[b][h]),
                        want[2] + len(p_sets[b][h]), want[3] + 1]
            if not dense[b] and b == 0 and h == 0:  # control: one more block changes A
                assert oracle.topk_set(row, nb, K + 1, SINK, LOCAL) != a
    assert stats.tolist() == want


@every_method
def test_on_scores_gets_the_scores_before_the_top_k(name, seed, monkeypatch):
    """``select(..., on_scores=f)`` calls ``f`` once with the selection's scores; a composed
    selection (the base class's) calls it before its top-K op, so the decode step can fork the
    predictor there. Control: another query's scores differ."""
    from sglang_prr import custom_ops
    from sglang_prr.methods.base import DSAMethod
    m = methods.get(name)
    rnd = random.Random(seed)
    lens = [rnd.randint(5 * 16, 12 * 16) for _ in range(3)]
    P = make_paged(seed, lens, hk=2, group=4, page=16)
    summary = P.method_summary(m)
    calls = []
    lists = custom_ops.select_lists
    monkeypatch.setattr(custom_ops, "select_lists",
                        lambda *a, **k: calls.append("lists") or lists(*a, **k))
    sel = m.select(P.q, summary, table=P.table, seq_lens=P.seq_lens,
                   spec=SelectSpec.of(K, SINK, LOCAL, 16), sm_scale=P.sm_scale,
                   on_scores=lambda s: calls.append(s.clone()))
    seen = [c for c in calls if not isinstance(c, str)]
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], sel.scores, rtol=0, atol=0, equal_nan=True)
    if type(m).select is DSAMethod.select:
        assert isinstance(calls[0], Tensor) and calls[1:] == ["lists"], calls
    other = m.scores(-P.q, summary, table=P.table, seq_lens=P.seq_lens, page_size=16,
                     sm_scale=P.sm_scale)
    assert not torch.equal(seen[0], other), "control: another query scores otherwise"


@every_method
def test_select_predict_equals_select_then_the_predictor(name, seed):
    m = methods.get(name)
    rnd = random.Random(seed)
    lens = [rnd.randint(5 * 16, 12 * 16) for _ in range(3)]
    P = make_paged(seed, lens, hk=2, group=4, page=16)
    summary = P.method_summary(m)
    R, hk, nb, width = 9, 2, P.nb, N_PRED + SINK + LOCAL + 1
    g = torch.Generator().manual_seed(seed)
    st = new_layer_state(R, hk, nb, width, (0.5, 0.3, 0.4), CPU)
    st.level.copy_(torch.randn(R, hk, nb, generator=g))
    st.n_init.copy_(torch.randint(0, nb, (R,), generator=g))
    p_idx, p_cnt, _, _ = _pool_p(3, hk, P.nblk, rnd, width, 2 * R)
    st.p_idx.copy_(p_idx)
    st.p_cnt.copy_(p_cnt)
    rows = torch.tensor(rnd.sample(range(1, R), 3))
    par = torch.tensor([rnd.randrange(2) for _ in range(3)])
    args = dict(table=P.table, seq_lens=P.seq_lens, nblk=P.nblk, spec=SelectSpec.of(
        K, SINK, LOCAL, 16), sm_scale=P.sm_scale, dense_row=torch.tensor([False, False, True]),
        stats=contracts.new_stats())
    fused = type(st)(*(t.clone() for t in st))
    got = m.select_predict(P.q, summary, nblk_next=P.nblk + 1, state=fused, rows=rows,
                           p_rows=2 * rows + par, p_next_rows=2 * rows + 1 - par, n_pred=N_PRED,
                           **args)
    args["stats"] = contracts.new_stats()
    want = m.select(P.q, summary, p_idx=st.p_idx, p_cnt=st.p_cnt, p_rows=2 * rows + par, **args)
    before = st.level.clone()
    ref.predict_update_rows(st.level, st.trend, st.n_init, st.p_idx, st.p_cnt, st.theta, rows,
                            want.scores, P.nblk, P.nblk + 1, N_PRED, SINK, LOCAL,
                            p_rows=2 * rows + 1 - par)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    for field, x, y in zip(st._fields, fused, st):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=field)
    assert not torch.equal(st.level[rows], before[rows]), "control: the predictor ran"


# ----------------------------------------------------------------------------- the decode step
@every_layout
def test_decode_step_equals_serial_dsa_over_the_methods_own_selection(name, keys, seed,
                                                                      monkeypatch):
    if keys is not None:
        monkeypatch.setenv(infllm_v2.ENV_CK, keys)
    m = methods.get(name)
    lens = [200, 97, 150, 181]
    P = make_paged(seed, lens, hk=2, group=4, page=16)
    summary = P.method_summary(m)  # over each request's whole length, past the steps below
    R, hk, nb = P.req_to_token.shape[0], 2, P.nb
    g = torch.Generator().manual_seed(seed + 1)
    prr, serial = (DecodeStep(name, K, N_PRED, SINK, LOCAL, 16, 0, exact=True, serial=s,
                              device=CPU) for s in (False, True))
    st = new_layer_state(R, hk, nb, N_PRED + SINK + LOCAL, (0.5, 0.3, 0.4), CPU)
    reused_and_repaired = 0
    for t in range(6):
        seq = torch.tensor([L - 8 + t for L in lens])
        # A fresh query every step, drifting around each request's own direction as much as it
        # keeps of it: P(t) hits part of A and misses part.
        q = P.q + 3 * torch.randn(P.q.shape, generator=g)
        stats = contracts.new_stats()
        o = prr.run(q, P.k_buf, P.v_buf, summary, prr.plan(P.req_to_token, P.rows, seq), st,
                    stats, P.sm_scale, torch.float32)
        bs = serial.plan(P.req_to_token, P.rows, seq)
        o_serial = serial.run(q, P.k_buf, P.v_buf, summary, bs, None, None, P.sm_scale,
                              torch.float32)
        a = m.select(q, summary, table=bs.table, seq_lens=seq, spec=serial.spec,
                     sm_scale=P.sm_scale, nblk=bs.nblk)
        want = ref.attend_set(q, P.k_buf, P.v_buf, bs.table, seq, a.a_idx, a.a_cnt, 16,
                              P.sm_scale)[0]
        msg = f"{name}, seed {seed}, step {t}"
        assert rel_err(o_serial, want) < 1e-5, msg
        assert rel_err(o, o_serial) < 1e-5, msg
        dense = ref.dense_attention(q, P.k_buf, P.v_buf, bs.table, seq, 16, P.sm_scale)
        assert rel_err(dense, o_serial) > 1e-2, msg  # control: the selection matters
        # Past the first step (empty P), P(t) both hit blocks of A (reuse) and missed some
        # (repair): both paths of the merge mattered.
        reused_and_repaired += t > 0 and 0 < int(stats[1]) < int(stats[0])
    assert reused_and_repaired, f"{name}: P(t) never both hit and missed A: vacuous"


# ----------------------------------------------------------------------------- graph safety
@every_method
def test_everything_runs_on_the_meta_device(name):
    """No host read of a tensor value anywhere in the method or the step around it (a .item(),
    .tolist() or data-dependent shape raises on meta tensors): CUDA-graph capturable."""
    m = methods.get(name)
    meta = torch.device("meta")
    B, hk, G, d, page, nb = 3, 2, 4, 16, 16, 9
    R, pages = 5, 40
    e = lambda *s, dt=torch.float32: torch.empty(*s, dtype=dt, device=meta)  # noqa: E731
    summary = [t[0] for t in m.allocate(1, pages, hk, d, page, meta)]
    k_buf, r2t = e(pages * page, hk, d), e(R, nb * page, dt=torch.int32)
    for n, decode in ((37, False), (B, True)):
        m.update(summary, e(n, hk, d), e(n, dt=torch.long), e(n, dt=torch.long), page,
                 decode=decode, key_buffer=k_buf, req_to_token=r2t,
                 token_req_idx=lambda n=n: e(n, dt=torch.long))
    q, seq = e(B, hk * G, d), e(B, dt=torch.long)
    table = e(B, nb, dt=torch.long)
    s = m.scores(q, summary, table=table, seq_lens=seq, page_size=page, sm_scale=0.25)
    assert s.shape == (B, hk, nb) and s.device == meta
    st = new_layer_state(R, hk, nb, N_PRED + SINK + LOCAL, (0.5, 0.3, 0.4), meta)
    sel = m.select(q, summary, table=table, seq_lens=seq, spec=SelectSpec.of(K, SINK, LOCAL, page),
                   sm_scale=0.25, p_idx=st.p_idx, p_cnt=st.p_cnt, p_rows=e(B, dt=torch.long),
                   dense_row=e(B, dt=torch.bool), stats=contracts.new_stats(meta))
    assert sel.m_idx.shape == (B, hk, K + SINK + LOCAL) and sel.m_idx.device == meta
    rows = e(B, dt=torch.long)
    for serial in (True, False):
        step = DecodeStep(name, K, N_PRED, SINK, LOCAL, page, 64, exact=True, serial=serial,
                          device=CPU)
        b = step.plan(r2t, rows, seq)
        o = step.run(q, k_buf, k_buf, summary, b, None if serial else st,
                     contracts.new_stats(meta), 0.25, torch.bfloat16)
        assert o.shape == (B, hk * G, d) and o.dtype == torch.bfloat16 and o.device == meta
    with pytest.raises(Exception):  # control: a host read does raise on the meta device
        float(s.sum())
