"""The step's new keys folded into Quest's selection (``new_k`` / ``new_pos`` of
``ops.quest_select`` and ``ops.quest_select_predict``): the scores, A and M equal those of the
selection after the decode update, bit for bit, whether or not the update has run (the fold is
idempotent), so ``DecodeStep`` may run the update beside the selection. With the keys' slots
(``new_loc``) the selection also writes them: the summaries equal the decode update's, bit for
bit, so the step runs no update. Negative controls: the same selection without the new keys, on
summaries that have not seen them, differs; without ``new_loc`` nothing is written; a method
without the fold refuses new keys. The kernels' side is ``tests/gpu/test_fold_new_keys.py``.
"""

from __future__ import annotations

import pytest
import torch

from sglang_prr import methods, ops
from sglang_prr import reference as ref
from sglang_prr.methods import NewKeys, SelectSpec


def _case(g, B, Hq, Hk, D, page, sdt, kdt):
    """Summaries of every page, distinct pages per row, each row's new key in its last block (at
    a random offset; row 0 at the first position of a fresh page, whose stored bounds are stale:
    another owner's). Keys three times wider than the summaries, so a fold moves the bounds."""
    NB = 7
    P = B * NB + 3
    kmin = torch.randn(P, Hk, D, generator=g)
    kmax = kmin + torch.rand(P, Hk, D, generator=g)
    kmin, kmax = kmin.to(sdt), kmax.to(sdt)
    if sdt == torch.bfloat16:
        kmin = ref.round_bf16(kmin.float(), down=True)
        kmax = ref.round_bf16(kmax.float(), down=False)
    table = (torch.randperm(P - 1, generator=g)[:B * NB] + 1).view(B, NB)
    nblk = torch.randint(1, NB + 1, (B,), generator=g)
    off = torch.randint(0, page, (B,), generator=g)
    off[0] = 0
    pos = (nblk - 1) * page + off
    loc = table[torch.arange(B), nblk - 1] * page + off
    k = (torch.randn(B, Hk, D, generator=g) * 3).to(kdt)
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16)
    return q, kmin, kmax, table, nblk, k, loc, pos


def _updated(kmin, kmax, k, loc, pos, page):
    a, b = kmin.clone(), kmax.clone()
    ref.quest_update(a, b, k, loc, pos, page, one_per_page=True)
    return a, b


@pytest.mark.parametrize("sdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kdt", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,Hq,Hk,D,page", [(1, 4, 1, 64, 16), (5, 6, 3, 24, 8), (3, 8, 2, 40, 64)])
def test_folded_selection_is_the_selection_after_the_update(seed, B, Hq, Hk, D, page, sdt, kdt):
    g = torch.Generator().manual_seed(seed)
    q, kmin, kmax, table, nblk, k, loc, pos = _case(g, B, Hq, Hk, D, page, sdt, kdt)
    k_sel, n_out = 2, 2 + 1 + 1
    upd = _updated(kmin, kmax, k, loc, pos, page)
    args = dict(p_idx=None, p_cnt=None, k=k_sel, sink_blocks=1, local_blocks=1, n_out=n_out)
    want = ops.quest_select(q, *upd, table, nblk, **args)
    fold = dict(new_k=k, new_pos=pos, page_size=page)
    before = ops.quest_select(q, kmin, kmax, table, nblk, **args, **fold)
    after = ops.quest_select(q, *upd, table, nblk, **args, **fold)  # folded twice: the same
    for got in (before, after):
        for x, y in zip(got, want):
            assert torch.equal(x, y)
    # The fold moved the newest blocks' scores (and nothing else).
    stale = ops.quest_select(q, kmin, kmax, table, nblk, **args)[0]
    last = torch.zeros_like(stale, dtype=torch.bool)
    last[torch.arange(B), :, nblk - 1] = True
    assert torch.equal(stale[~last], want[0][~last])
    assert not torch.equal(stale[last], want[0][last])


@pytest.mark.parametrize("sdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kdt", [torch.float16, torch.float32])
@pytest.mark.parametrize("B,Hq,Hk,D,page", [(1, 4, 1, 64, 16), (5, 6, 3, 24, 8)])
def test_selection_with_slots_writes_the_update(seed, B, Hq, Hk, D, page, sdt, kdt):
    g = torch.Generator().manual_seed(seed)
    q, kmin, kmax, table, nblk, k, loc, pos = _case(g, B, Hq, Hk, D, page, sdt, kdt)
    args = dict(p_idx=None, p_cnt=None, k=2, sink_blocks=1, local_blocks=1, n_out=4)
    upd = _updated(kmin, kmax, k, loc, pos, page)
    want = ops.quest_select(q, *upd, table, nblk, **args)
    fold = dict(new_k=k, new_pos=pos, page_size=page)
    lo, hi = kmin.clone(), kmax.clone()
    got = ops.quest_select(q, lo, hi, table, nblk, **args, **fold, new_loc=loc)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    # every page but page 0, the padding sink, which the update resets for rows it folds into
    assert torch.equal(lo[1:], upd[0][1:]) and torch.equal(hi[1:], upd[1][1:])
    assert not torch.equal(lo, kmin)  # the keys moved the bounds
    # control: without the slots the selection folds and writes nothing
    lo2, hi2 = kmin.clone(), kmax.clone()
    ops.quest_select(q, lo2, hi2, table, nblk, **args, **fold)
    assert torch.equal(lo2, kmin) and torch.equal(hi2, kmax)


def test_rows_that_fold_nothing_write_only_the_padding_page(seed):
    """A negative position, or one past the row's blocks, writes page 0 (the padding sink, as the
    update resets it); every other page is the update's of the remaining rows."""
    g = torch.Generator().manual_seed(seed)
    page = 16
    q, kmin, kmax, table, nblk, k, loc, pos = _case(g, 4, 4, 2, 32, page, torch.bfloat16,
                                                     torch.float32)
    pos = pos.clone()
    pos[1] = -1
    pos[2] = nblk[2] * page + 3
    keep = torch.tensor([True, False, False, True])
    upd = _updated(kmin, kmax, k[keep], loc[keep], pos[keep], page)
    lo, hi = kmin.clone(), kmax.clone()
    ops.quest_select(q, lo, hi, table, nblk, None, None, 2, 1, 1, 4, new_k=k, new_pos=pos,
                     page_size=page, new_loc=loc)
    assert torch.equal(lo[1:], upd[0][1:]) and torch.equal(hi[1:], upd[1][1:])
    assert not torch.equal(lo[1:], kmin[1:])  # control: rows 0 and 3 did write


def test_fold_skips_positions_outside_the_row(seed):
    """A negative position, or one in a block at or past ``nblk``, folds nothing."""
    g = torch.Generator().manual_seed(seed)
    q, kmin, kmax, table, nblk, k, loc, pos = _case(g, 3, 4, 2, 32, 16, torch.bfloat16,
                                                     torch.bfloat16)
    pos = pos.clone()
    pos[0] = -1
    pos[1] = nblk[1] * 16 + 3  # the next block: not one of the row's
    s = ops.quest_scores(q, kmin, kmax, table, nblk)
    sf = ref.quest_scores(q, kmin, kmax, table, nblk, k, pos, 16)
    assert torch.equal(s[:2], sf[:2])
    assert not torch.equal(s[2], sf[2])


def test_select_predict_folds_like_select(seed):
    """``quest_select_predict``: the same selection and the same predictor state after the
    update as with the new keys folded before it."""
    g = torch.Generator().manual_seed(seed)
    B, Hk, page = 4, 2, 16
    q, kmin, kmax, table, nblk, k, loc, pos = _case(g, B, 4, Hk, 32, page, torch.bfloat16,
                                                     torch.float16)
    NB, R, W = table.shape[1], B + 1, 8
    rows = torch.randperm(R, generator=g)[:B]

    def state():
        gg = torch.Generator().manual_seed(seed + 1)
        return [torch.full((2 * R, Hk, W), -1, dtype=torch.int32),
                torch.zeros(2 * R, Hk, dtype=torch.int32), torch.randn(R, Hk, NB, generator=gg),
                torch.randn(R, Hk, NB, generator=gg), torch.randint(0, NB, (R,), generator=gg),
                torch.rand(R, 3, generator=gg)]

    def run(summ, **fold):
        st = state()
        out = ops.quest_select_predict(q, *summ, table, nblk, torch.clamp(nblk + 1, max=NB),
                                       st[0], st[1], 2 * rows, 2 * rows + 1, st[2], st[3], st[4],
                                       st[5], rows, k=2, n_pred=3, sink_blocks=1, local_blocks=1,
                                       n_out=4, **fold)
        return list(out) + st[:5]

    upd = _updated(kmin, kmax, k, loc, pos, page)
    want = run(upd)
    got = run((kmin, kmax), new_k=k, new_pos=pos, page_size=page)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    lo, hi = kmin.clone(), kmax.clone()  # with the slots: the same, and the update written
    got = run((lo, hi), new_k=k, new_pos=pos, page_size=page, new_loc=loc)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(lo[1:], upd[0][1:]) and torch.equal(hi[1:], upd[1][1:])
    stale = run((kmin, kmax))
    assert not torch.equal(stale[0], want[0])


def test_methods_take_new_keys_only_where_they_fold(seed):
    g = torch.Generator().manual_seed(seed)
    q, kmin, kmax, table, nblk, k, loc, pos = _case(g, 2, 4, 2, 32, 16, torch.bfloat16,
                                                     torch.bfloat16)
    nk = NewKeys(k, loc, pos)
    spec = SelectSpec.of(2, 1, 1, 16)
    sl = (nblk - 1) * 16 + 1
    quest = methods.get("quest")
    assert quest.folds_new_keys
    sel = quest.select(q, (kmin, kmax), table=table, seq_lens=sl, spec=spec, sm_scale=1.0,
                       nblk=nblk, new_keys=nk)
    want = ops.quest_select(q, *_updated(kmin, kmax, k, loc, pos, 16), table, nblk, None, None,
                            2, 1, 1, 4)
    assert torch.equal(sel.scores, want[0])
    infllm = methods.get("infllm_v2")
    assert not infllm.folds_new_keys
    with pytest.raises(ValueError, match="folds_new_keys"):
        infllm.select(q, (torch.zeros(9, 1, 2, 32),), table=table, seq_lens=sl, spec=spec,
                      sm_scale=1.0, nblk=nblk, new_keys=nk)


@pytest.mark.parametrize("bad,match", [
    (dict(new_k="shape"), "new_k"), (dict(new_k="int"), "new_k"), (dict(new_pos=None), "new_pos"),
    (dict(new_pos="float"), "new_pos.dtype"), (dict(new_pos="len"), "new_pos.shape"),
    (dict(page_size=0), "page_size"), (dict(new_k=None), "new_pos"),
    (dict(new_loc="float"), "new_loc.dtype"), (dict(new_loc="len"), "new_loc.shape"),
    (dict(new_k=None, new_pos=None, new_loc="loc"), "new_loc")])
def test_new_key_arguments_are_checked(seed, bad, match):
    g = torch.Generator().manual_seed(seed)
    q, kmin, kmax, table, nblk, k, loc, pos = _case(g, 2, 4, 2, 32, 16, torch.bfloat16,
                                                     torch.bfloat16)
    args = dict(new_k=k, new_pos=pos, page_size=16, new_loc=loc)
    for key, v in bad.items():
        src = pos if key == "new_pos" else loc
        args[key] = {"shape": k[:, :1], "int": k.int(), "float": src.float(), "len": src[:1],
                     "loc": loc}.get(v, v) if isinstance(v, str) else v
    lo, hi = kmin.clone(), kmax.clone()
    with pytest.raises(ValueError, match=match):
        ops.quest_select(q, lo, hi, table, nblk, None, None, 2, 1, 1, 4, **args)
    assert torch.equal(lo, kmin) and torch.equal(hi, kmax)  # a refused call writes nothing
    with pytest.raises(ValueError, match=match):
        ops.quest_select(q, kmin, kmax, table, nblk, None, None, 2, 1, 1, 4, **args)
    ops.quest_select(q, kmin, kmax, table, nblk, None, None, 2, 1, 1, 4, new_k=k, new_pos=pos,
                     page_size=16)  # control: the good arguments pass


@pytest.mark.parametrize("method,fold,where,want", [
    ("quest", True, "select", [("store",), ("select", True, True)]),
    ("quest", True, "side", [("store",), ("update",), ("select", True, False)]),
    ("quest", False, "select", [("store",), ("update",), ("select", False, False)]),
    ("infllm_v2", True, "select", [("store",), ("update",), ("select", False, False)])])
def test_decode_step_places_the_update(seed, monkeypatch, method, fold, where, want):
    """``DecodeStep`` hands the new keys with their slots to a selection that writes them, and
    then runs no update; else it runs the update first on CPU (on CUDA, where the selection folds
    the keys, beside it: ``SGLANG_PRR_SUMMARY_UPDATE=side``) and hands the keys, without slots,
    to the selection only where the method folds them (and ``SGLANG_PRR_FOLD_NEW_KEYS`` is not
    0); the output is serial DSA's either way (against the update first, no new keys). The KV
    store runs before all of them (on CPU also with ``SGLANG_PRR_KV_STORE=beside``, a CUDA
    placement)."""
    monkeypatch.setenv("SGLANG_PRR_SUMMARY_UPDATE", where)
    monkeypatch.setenv("SGLANG_PRR_KV_STORE", "beside")
    from sglang_prr.step import DecodeStep
    from sglang_prr.tools.synthetic import paged_kv
    g = torch.Generator().manual_seed(seed)
    page, hk, d, B = 16, 2, 32, 2
    kv = paged_kv(B, 20 * page + 5, page, hk, d, dtype=torch.float32, device="cpu", generator=g)
    dsa = methods.get(method)
    summary = ([kv.kmin, kv.kmax] if method == "quest" else
               dsa.allocate(1, kv.k_buf.shape[0] // page + 1, hk, d, page, "cpu"))
    summary = [t[0] if method != "quest" else t for t in summary]
    calls = []
    orig = type(dsa).select

    def spy(self, *a, **k):
        nk = k.get("new_keys")
        calls.append(("select", nk is not None, nk is not None and nk.loc is not None))
        return orig(self, *a, **k)

    monkeypatch.setattr(type(dsa), "select", spy)
    seq = torch.full((B,), 20 * page + 5)
    q = torch.randn(B, 4 * hk, d, generator=g)
    knew = torch.randn(B, hk, d, generator=g)
    pos = seq - 1
    loc = kv.req_to_token[kv.rows, pos].long()
    step = DecodeStep(method, 4, 6, 1, 1, page, min_context=0, exact=True, serial=True,
                      device="cpu")
    step.fold_keys = fold
    b = step.plan(kv.req_to_token, kv.rows, seq)
    o = step.run(q, kv.k_buf, kv.v_buf, summary, b, None, None, 0.2, torch.float32,
                 new_keys=NewKeys(knew, loc, pos), update=lambda: calls.append(("update",)),
                 store=lambda: calls.append(("store",)))
    assert calls == want
    calls.clear()
    o2 = step.run(q, kv.k_buf, kv.v_buf, summary, b, None, None, 0.2, torch.float32)
    assert calls == [("select", False, False)]  # control: without them, nothing is updated
    assert torch.equal(o, o2)


def test_decode_step_writing_selection_is_the_update_first(seed, monkeypatch):
    """Serial DSA and PRR through ``DecodeStep`` on CPU: the selection that writes the new keys
    gives the outputs and the summaries of the update first, bit for bit; the summaries it left
    hold the keys (control: they differ from the summaries before the step)."""
    from sglang_prr.step import DecodeStep, new_layer_state
    from sglang_prr.tools.synthetic import paged_kv
    g = torch.Generator().manual_seed(seed)
    page, hk, d, B = 16, 2, 32, 3
    kv = paged_kv(B, 20 * page + 5, page, hk, d, dtype=torch.float32, device="cpu", generator=g)
    seq = torch.tensor([20 * page + 5, 9 * page + 1, 13 * page + 16])
    q = torch.randn(B, 4 * hk, d, generator=g)
    knew = torch.randn(B, hk, d, generator=g) * 3
    pos = seq - 1
    loc = kv.req_to_token[kv.rows, pos].long()
    quest = methods.get("quest")
    outs = {}
    for where in ("select", "side"):
        monkeypatch.setenv("SGLANG_PRR_SUMMARY_UPDATE", where)
        for serial in (True, False):
            summ = [kv.kmin.clone(), kv.kmax.clone()]
            step = DecodeStep("quest", 4, 6, 1, 1, page, min_context=0, exact=True,
                              serial=serial, device="cpu")
            st = None if serial else new_layer_state(kv.req_to_token.shape[0], hk,
                                                     -(-kv.req_to_token.shape[1] // page), 8,
                                                     (0.5, 0.5, 0.5), "cpu")
            b = step.plan(kv.req_to_token, kv.rows, seq)

            def upd(s=summ):
                quest.update(s, knew, loc, pos, page, decode=True)

            o = step.run(q, kv.k_buf, kv.v_buf, summ, b, st, None, 0.2, torch.float32,
                         new_keys=NewKeys(knew, loc, pos), update=upd)
            outs[where, serial] = (o, summ)
    for serial in (True, False):
        (o1, s1), (o2, s2) = outs["select", serial], outs["side", serial]
        assert torch.equal(o1, o2)
        assert all(torch.equal(x, y) for x, y in zip(s1, s2))
        assert not torch.equal(s1[0], kv.kmin)
    monkeypatch.setenv("SGLANG_PRR_SUMMARY_UPDATE", "before")
    with pytest.raises(ValueError, match="SGLANG_PRR_SUMMARY_UPDATE"):
        DecodeStep("quest", 4, 6, 1, 1, page, min_context=0, exact=True, serial=True,
                   device="cpu")


@pytest.mark.parametrize("name,attr,other,default,serial", [
    ("SGLANG_PRR_SPEC_ORDER", "spec_first", "first", "after", False),
    ("SGLANG_PRR_KV_STORE", "store_beside", "beside", "first", True)])
@pytest.mark.parametrize("value", ["other", "default", None])
def test_step_knobs_are_read_and_checked(monkeypatch, name, attr, other, default, serial, value):
    """``SGLANG_PRR_SPEC_ORDER`` sets where PRR's speculative pass is recorded (default: after
    the selection), ``SGLANG_PRR_KV_STORE`` where the step's KV store runs (default: first),
    ``SGLANG_PRR_PREDICT_ORDER`` where the predictor's own launch goes (default: right after the
    selection); any other value is refused with its name (control)."""
    from sglang_prr.step import DecodeStep
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, other if value == "other" else default)
    step = DecodeStep("quest", 4, 6, 1, 1, 16, min_context=0, exact=True, serial=serial,
                      device="cpu")
    assert getattr(step, attr) is (value == "other")
    monkeypatch.setenv(name, "before")
    with pytest.raises(ValueError, match=f"{name}='before'"):
        DecodeStep("quest", 4, 6, 1, 1, 16, min_context=0, exact=True, serial=serial,
                   device="cpu")


@pytest.mark.parametrize("value,quest,infllm", [
    (None, "selection", "repair"), ("selection", "selection", "selection"),
    ("repair", "repair", "repair"), ("next", "next", "next"), ("scores", "scores", "scores")])
def test_the_predictors_own_launch_follows_the_repair_for_composed_methods(monkeypatch, value,
                                                                          quest, infllm):
    """Unset, ``SGLANG_PRR_PREDICT_ORDER`` leaves the predictor's own launch right after the
    selection for Quest (whose selection can fuse it) and puts it after the repair for InfLLM-v2;
    any of its values forces it for both, any other value is refused with its name (control)."""
    from sglang_prr.step import DecodeStep, predictor_placement
    if value is None:
        monkeypatch.delenv("SGLANG_PRR_PREDICT_ORDER", raising=False)
    else:
        monkeypatch.setenv("SGLANG_PRR_PREDICT_ORDER", value)
    assert (predictor_placement("quest"), predictor_placement("infllm_v2")) == (quest, infllm)
    got = [DecodeStep(m, 4, 6, 1, 1, 16, min_context=0, exact=True, serial=False, device="cpu",
                      fuse_predictor=False).predict_at for m in ("quest", "infllm_v2")]
    assert got == [quest, infllm]
    monkeypatch.setenv("SGLANG_PRR_PREDICT_ORDER", "later")
    with pytest.raises(ValueError, match="SGLANG_PRR_PREDICT_ORDER='later'"):
        DecodeStep("infllm_v2", 4, 6, 1, 1, 16, min_context=0, exact=True, serial=False,
                   device="cpu")
