"""The sparse decode step of one layer: serial DSA or PRR, on the request pool's state in place.

One ``DecodeStep`` per server, built once with the step's constants; ``plan`` runs once per
forward pass (the values every layer shares), ``run`` once per layer. Shapes are static and
counts live on the device, so both record into SGLang's decode CUDA graphs. On SM90 each stage is
one kernel launch and nothing else is launched (no gathers, casts or statistics glue):

```
serial DSA (Quest), per layer:
main : [select: scores (new keys folded and written), A] -> [attention over A + merge -> o]

PRR (Quest), per layer:
main : -fork-> [speculative attention over P(t)] --wait(A, M)-> [repair over M + merge in
side :    \\-> [select: scores, A, M = A \\ P(t); Holt update, P(t+1)] -/   ascending block id]
```

The summary update is no launch of its own: Quest's selection folds the step's new keys into the
scores of their blocks in registers (``folds_new_keys``) and stores the folded bounds, which is
the update (``writes_new_keys``: a few bytes a row from the lanes that hold them). The fold is
idempotent (a min/max), so the scores do not depend on whether the summaries held the key yet.
With ``SGLANG_PRR_SUMMARY_UPDATE=side`` (a measuring knob) the selection only folds and the
update runs as its own launch on the side stream, after the attention (serial DSA) or the
selection (PRR), joined after the last layer. Methods without the fold (InfLLM-v2) run the update
first, as does ``SGLANG_PRR_FOLD_NEW_KEYS=0``. ``SGLANG_PRR_SPEC_ORDER=first`` (another measuring
knob) records PRR's speculative pass before the selection instead of after it.

The predictor's step is the selection's epilogue (the scores are on chip there; with
``--prr-predictor side`` it is its own launch after the selection, as below): it writes P(t+1)
into the other half of a double buffer of P (``DecodeBatch.p_cur`` / ``p_nxt``: rows
``2 r + s % 2`` and ``2 r + 1 - s % 2`` of the pool's P, s the request's length with the decoded
token; the next decode step, of length s + 1, reads the half this one writes), so it never
races the speculative pass or the merge, which read P(t), and the parity costs no state and no
launch. The main stream's wait for the selection is the only join. The selection is the DSA
method's (``methods/``, picked once by name): Quest's is that one launch (``fuses_predictor``);
InfLLM-v2's composes its scores, then its top-K, M and counters in one launch
(``select_lists``; with ``--prr-predictor fused``, ``select_lists_predict``: the predictor's CTAs
beside the top-K's in that launch), and with ``side`` the predictor's step follows on the side
stream (joined once per forward, after the last sparse layer: ``run(..., join=True)``) after
the repair (``predictor_placement``: beside the repair, it slowed a merge-alone repair
twofold), or, with
``SGLANG_PRR_PREDICT_ORDER=next``, on the main stream at the next sparse layer's fork, before its
speculative pass: beside that layer's selection rather than beside its GEMMs; with
``SGLANG_PRR_PREDICT_ORDER=scores``, on a stream of its own forked as soon as the scores exist,
beside the selection's top-K and the repair.

The repair's merge visits the partials of A in ascending block id whichever pass computed
them, so PRR (exact) gives serial DSA's output bits.

Whether a forward speculates, and over how many blocks, is decided per batch size when it is
planned (``budget``: the ``--prr-budget auto`` policy, ``budget.BudgetPolicy``): SGLang captures
one decode graph per batch size, so the choice is static inside each graph. A forward that does
not speculate runs serial DSA and leaves the predictor state as it was (P is then stale, which
costs hit rate, never exactness).

Rows shorter than ``min_context`` tokens take the same kernels with A = every block (DSA with K >=
all blocks is dense attention), so no batch needs a second attention pass; the selection kernel
leaves them out of the statistics.

On CPU (and other devices) every op is the torch reference and the stages run one after another.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from . import methods, ops
from .methods import NewKeys, SelectSpec

ENV_FOLD_NEW_KEYS = "SGLANG_PRR_FOLD_NEW_KEYS"
ENV_SUMMARY_UPDATE = "SGLANG_PRR_SUMMARY_UPDATE"
ENV_SPEC_ORDER = "SGLANG_PRR_SPEC_ORDER"
ENV_KV_STORE = "SGLANG_PRR_KV_STORE"
ENV_PREDICT_ORDER = "SGLANG_PRR_PREDICT_ORDER"


def _env_choice(name: str, default: str, other: str) -> str:
    """The value of the environment knob ``name`` (``default`` when unset); any value but the
    two is refused with its name."""
    value = os.environ.get(name, default)
    if value not in (default, other):
        raise ValueError(f"{name}={value!r}: expected {default!r} or {other!r}")
    return value


PREDICT_PLACES = ("selection", "repair", "next", "scores")


def predictor_placement(method: str) -> str:
    """Where PRR's predictor step goes where it is a launch of its own (not the selection's
    epilogue): ``selection``, on the side stream right after the selection, beside the repair;
    ``repair``, on the side stream after the repair, beside the layer's next kernels;
    ``scores``, on a stream of its own as soon as the scores exist (a composed selection's first
    op: beside its top-K and the repair; a one-launch selection's: as ``selection``); ``next``,
    on the main stream at the next sparse layer's fork, before that layer's speculative pass and
    beside its selection (the forward's last sparse layer, which joins, after its repair).
    ``SGLANG_PRR_PREDICT_ORDER`` forces one (a measuring knob), else the method's measured
    placement. A method whose selection fuses the predictor (Quest) keeps it beside the repair:
    after it, it ran beside the next layer's GEMMs and the ITL rose 1.7% (128K / 1, run 53). A
    composed method (InfLLM-v2) puts it after: beside it, the repair's merge took 18.8 us instead
    of 9.5 and the ITL was 3.7% higher (run 53). At the next fork both were slower at 128K / 1
    (the selection beside it took its length longer; run 55)."""
    order = os.environ.get(ENV_PREDICT_ORDER)
    if order is not None and order not in PREDICT_PLACES:
        raise ValueError(f"{ENV_PREDICT_ORDER}={order!r}: expected one of {PREDICT_PLACES}")
    if order:
        return order
    return methods.get(method).predictor_place


def p_rows(rows: Tensor, seq_lens: Union[Tensor, int]) -> Tensor:
    """Rows of the pool's P (``[2R, ...]``, double-buffered) that hold P(t) for the decode
    step of requests in slots ``rows`` (``[B]``) whose length, the decoded token included, is
    ``seq_lens`` (``[B]``, or one length for all): ``2 r + s % 2``, int64 ``[B]``. The step
    writes P(t+1) into the other half of the pair, ``2 r + 1 - s % 2``, which the next step
    (length s + 1) reads."""
    if isinstance(seq_lens, int):
        return rows.long() * 2 + seq_lens % 2
    return torch.add(seq_lens.long() & 1, rows.long(), alpha=2)


class DecodeBatch(NamedTuple):
    """Per-forward values every layer shares (``DecodeStep.plan``)."""

    rows: Tensor       # [B] request slots (SGLang's req_pool_indices); state rows
    p_cur: Tensor      # [B] int64 rows of the pool's P holding P(t) (2 r + s % 2)
    p_nxt: Tensor      # [B] int64 rows receiving P(t+1) (2 r + 1 - s % 2)
    table: Tensor      # [B, NB] int32 page id of every block
    seq_lens: Tensor   # [B] tokens, the one being decoded included
    nblk: Tensor       # [B] int64 blocks now
    nblk_next: Tensor  # [B] int64 blocks at the next step (for P(t+1))
    dense_row: Tensor  # [B] bool: shorter than min_context, attends every block
    n_pred: int        # |P| in blocks this forward predicts; 0: serial DSA


class LayerState(NamedTuple):
    """One layer's predictor state in the request pool (views of ``PRRState``), ``R`` rows."""

    p_idx: Tensor  # [2R, Hk, Np] int32 prediction P, double-buffered: rows 2r and 2r + 1
    p_cnt: Tensor  # [2R, Hk] int32
    level: Tensor  # [R, Hk, NB] float32
    trend: Tensor  # [R, Hk, NB] float32
    n_init: Tensor  # [R] int64 blocks with state
    theta: Tensor  # [R, 3] float32 (alpha, beta, gamma)


def new_layer_state(rows: int, num_kv_heads: int, num_blocks: int, p_width: int,
                    theta, device) -> LayerState:
    """A zeroed ``LayerState`` of ``rows`` request slots (for tests and benchmarks; the server's
    lives in ``PRRState``): empty predictions, no blocks with state, ``theta: (alpha, beta,
    gamma)`` in every row."""
    R, Hk = rows, num_kv_heads
    return LayerState(torch.full((2 * R, Hk, p_width), -1, dtype=torch.int32, device=device),
                      torch.zeros(2 * R, Hk, dtype=torch.int32, device=device),
                      torch.zeros(R, Hk, num_blocks, device=device),
                      torch.zeros(R, Hk, num_blocks, device=device),
                      torch.zeros(R, dtype=torch.long, device=device),
                      torch.tensor([list(theta)] * R, dtype=torch.float32, device=device))


class DecodeStep:
    """Serial DSA or PRR decode of one layer (see the module docstring).

    method: a registered DSA method (``methods.get``: ``quest`` | ``infllm_v2``); k / n_pred: K
    and |P| max in blocks; sink / local: kept blocks; exact: attend exactly A (else P u A);
    serial: serial DSA instead of PRR, always;
    budget: batch size -> |P| in blocks (at most ``n_pred``; 0: serial DSA for that batch size),
    ``n_pred`` for every batch size when None; skip_repair: debug negative control (M forced
    empty, so PRR(exact) != serial DSA); fuse_predictor: the predictor's step in the selection's
    epilogue where the method has that op (``fuses_predictor``), else its own launch after the
    selection on the side stream (``--prr-predictor``; the same state and P(t+1) either way).
    """

    def __init__(self, method: str, k: int, n_pred: int, sink: int, local: int, page_size: int,
                 min_context: int, exact: bool, serial: bool, device: torch.device,
                 skip_repair: bool = False, budget: Optional[Callable[[int], int]] = None,
                 fuse_predictor: bool = True):
        self.method, self.k, self.n_pred = method, int(k), int(n_pred)
        self.dsa = methods.get(method)
        self.fused = bool(fuse_predictor) and self.dsa.fuses_predictor
        self.budget = budget
        self.sink, self.local, self.page = int(sink), int(local), int(page_size)
        self.min_context = int(min_context)
        self.exact, self.serial, self.skip_repair = bool(exact), bool(serial), bool(skip_repair)
        # Width of A and M: K + kept blocks, or every block of the longest dense row.
        self.n_out = max(self.k + self.sink + self.local,
                         -(-max(self.min_context - 1, 0) // self.page))
        # The selection's constants, the same for every forward and graph shape of this step.
        self.spec = SelectSpec(k=self.k, sink_blocks=self.sink, local_blocks=self.local,
                               n_out=self.n_out, page_size=self.page)
        # SGLANG_PRR_FOLD_NEW_KEYS=0: the summary update first and no fold, as before the fold
        # existed (a measuring knob: the two orders side by side in one run).
        self.fold_keys = os.environ.get(ENV_FOLD_NEW_KEYS, "1") != "0"
        # SGLANG_PRR_SUMMARY_UPDATE=side: the update as its own launch on the side stream (the
        # placement before the selection wrote the summaries itself; a measuring knob).
        self.write_keys = _env_choice(ENV_SUMMARY_UPDATE, "select", "side") == "select"
        # SGLANG_PRR_SPEC_ORDER=first: the speculative pass is launched before the selection
        # (default: after it). The two have no dependency; a CUDA graph dispatches independent
        # kernels in the order they were recorded, and the first one's CTAs take the SMs, so the
        # order decides which one waits for room (a measuring knob).
        self.spec_first = _env_choice(ENV_SPEC_ORDER, "after", "first") == "first"
        # SGLANG_PRR_KV_STORE=beside: the step's KV store (``run``'s ``store``) runs beside the
        # selection where the selection writes the new keys itself and so reads nothing of the
        # pool: serial DSA's on the side stream, joined before the attention; PRR's on the main
        # stream after the fork, before the speculative pass (default: first, before the step;
        # a measuring knob).
        self.store_beside = _env_choice(ENV_KV_STORE, "first", "beside") == "beside"
        # The predictor's own launch (where it is not in the selection's epilogue) on the side
        # stream right after the selection, beside the repair, after the repair, beside the
        # layer's next kernels, on a stream of its own once the scores exist, or at the next
        # sparse layer's fork (predictor_placement). P(t+1) is read at the next step only, and
        # the forward's join waits for it in every placement.
        self.predict_at = predictor_placement(method)
        # A layer's predictor step deferred to the next sparse layer's fork (``next``): set by
        # ``run``, launched by the next ``run``, dropped by ``plan`` (a forward's own).
        self._deferred: Optional[Callable[[], None]] = None
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.side = torch.cuda.Stream(device=self.device)
            self.forked = torch.cuda.Event()
            self.selected = torch.cuda.Event()
            self.side_done = torch.cuda.Event()
            self.stored = torch.cuda.Event()
            # ``scores``: the predictor's stream, forked from the side one after the scores
            # (made whatever the placement: tests set ``predict_at`` after construction)
            self.pred = torch.cuda.Stream(device=self.device)
            self.scored = torch.cuda.Event()
            self.pred_done = torch.cuda.Event()

    # ------------------------------------------------------------------ once per forward
    def plan(self, req_to_token: Tensor, req_pool_indices: Tensor,
             seq_lens: Tensor) -> DecodeBatch:
        """The values all layers share: a handful of small launches per forward, none per layer,
        the same for serial DSA and PRR.

        req_to_token: ``[R, max_ctx]`` int32 slots; req_pool_indices, seq_lens: ``[B]``. P's
        double buffer is addressed by the parity of the length (``p_rows``), so a request that
        sits a forward out, or decodes one without speculation, only reads an older P (hit rate,
        never exactness)."""
        p = self.page
        self._deferred = None  # never carried from one forward into another
        n_pred = 0 if self.serial else self.n_pred
        if n_pred and self.budget is not None:
            n_pred = int(self.budget(int(seq_lens.shape[0])))
            if not 0 <= n_pred <= self.n_pred:
                raise ValueError(f"budget gave |P| = {n_pred} blocks for batch "
                                 f"{seq_lens.shape[0]}; allowed: 0..{self.n_pred} (the static "
                                 f"width)")
        table = req_to_token[:, ::p].index_select(0, req_pool_indices)  # [B, NB] first slots
        table = table.div_(p, rounding_mode="floor")
        s = seq_lens.long()
        p_cur = p_rows(req_pool_indices, s)
        return DecodeBatch(rows=req_pool_indices, p_cur=p_cur, p_nxt=p_cur ^ 1,
                           table=table, seq_lens=seq_lens,
                           nblk=(s + (p - 1)).div_(p, rounding_mode="floor"),
                           nblk_next=s.div(p, rounding_mode="floor").add_(1),
                           dense_row=seq_lens < self.min_context, n_pred=n_pred)

    # ------------------------------------------------------------------ once per layer
    def run(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, summary: Sequence[Tensor],
            batch: DecodeBatch, state: Optional[LayerState], stats: Optional[Tensor],
            sm_scale: float, out_dtype: torch.dtype, join: bool = True,
            new_keys: Optional[NewKeys] = None,
            update: Optional[Callable[[], None]] = None,
            store: Optional[Callable[[], None]] = None, keep: Sequence[Tensor] = ()) -> Tensor:
        """One layer's decode attention: ``o [B, Hq, D]`` in ``out_dtype``.

        q: ``[B, Hq, D]`` (rows may be strided, heads packed); k_buf/v_buf: the layer's
        ``[slots, Hk, D]`` pool buffers; summary: the layer's summary tensors (the method's
        ``layout``: ``(kmin, kmax)``, ``(ck,)``);
        state: the layer's predictor state (PRR; updated in place, P(t+1) included, P's rows
        double-buffered: ``[2R, Hk, Np]``); stats: ``[4]`` int64 counters
        (``reference.accumulate_stats``) or None; join: end this forward's side-stream work here
        (the last sparse layer; the predictor's own step and the summary update run there);
        new_keys / update: the step's new keys and the summary update that folds them in (where
        the method's selection writes the new keys itself, that selection is the update and
        ``update`` is not called; else ``update`` runs first, or, where the selection folds
        the keys into its scores, on the side stream after the selection (PRR) or the
        attention (serial DSA), off the critical path); store / keep: the step's KV store of the
        new tokens and the tensors it reads, run first, or (``SGLANG_PRR_KV_STORE=beside``, where
        the selection writes the new keys) beside the selection, before anything that reads the
        pool."""
        b, dsa = batch, self.dsa
        fold = new_keys is not None and dsa.folds_new_keys and self.fold_keys
        writes = fold and dsa.writes_new_keys and self.write_keys
        beside = store is not None and writes and self.store_beside and self.cuda
        if store is not None and not beside:
            store()  # before the update, which may read the pool
        if fold and not writes:
            new_keys = new_keys._replace(loc=None)  # fold only: the update runs below
        side_update = fold and not writes and update is not None and self.cuda
        if update is not None and not side_update and not writes:
            update()  # the selection reads what it wrote
        # A serial forward of a speculating server leaves the PRR counters alone (its M = A
        # would read as misses); the host counts those steps.
        sel = dict(table=b.table, seq_lens=b.seq_lens, nblk=b.nblk, spec=self.spec,
                   sm_scale=sm_scale, dense_row=b.dense_row,
                   stats=stats if (b.n_pred or self.serial) else None,
                   new_keys=new_keys if fold else None)
        attn = dict(table=b.table, seq_lens=b.seq_lens, page_size=self.page, sm_scale=sm_scale,
                    out_dtype=out_dtype)
        if b.n_pred == 0:
            if beside:  # the store on the side stream, the attention joins it
                self._beside(store, keep, self.stored)
            a = dsa.select(q, summary, **sel)
            if beside:
                torch.cuda.current_stream(self.device).wait_event(self.stored)
            o = ops.sparse_attn_merge(q, k_buf, v_buf, idx=a.a_idx, cnt=a.a_cnt, **attn)[0]
            if side_update:  # after the attention, beside the layer's next kernels
                self._beside(update, new_keys, self.side_done)
                if join:
                    torch.cuda.current_stream(self.device).wait_event(self.side_done)
            return o
        st = state
        if st.p_idx.shape[0] != 2 * st.level.shape[0]:
            raise ValueError(f"state.p_idx has {st.p_idx.shape[0]} rows, expected 2 x "
                             f"{st.level.shape[0]} (P is double-buffered: rows 2r and 2r + 1)")
        fused = self.fused
        early = self.cuda and not fused and self.predict_at == "scores"

        def select():
            if fused:  # the predictor's step in the selection's epilogue
                return dsa.select_predict(q, summary, nblk_next=b.nblk_next, state=st,
                                          rows=b.rows, p_rows=b.p_cur, p_next_rows=b.p_nxt,
                                          n_pred=b.n_pred, **sel)
            return dsa.select(q, summary, p_idx=st.p_idx, p_cnt=st.p_cnt, p_rows=b.p_cur,
                              on_scores=predict_early if early else None, **sel)

        def predict(scores):  # P(t+1) into the other half of P's double buffer
            ops.predict_update_rows(level=st.level, trend=st.trend, n_init=st.n_init,
                                    p_idx=st.p_idx, p_cnt=st.p_cnt, theta=st.theta, rows=b.rows,
                                    scores=scores, nblk=b.nblk, nblk_next=b.nblk_next,
                                    n_pred=b.n_pred, sink_blocks=self.sink,
                                    local_blocks=self.local, p_rows=b.p_nxt)

        def predict_early(scores):  # ``scores``: forked from the side stream onto its own
            # The top-K and M read P(t) and the scores, the predictor writes P(t + 1) and the
            # Holt state: nothing the rest of the selection reads, so they run side by side.
            self.scored.record(self.side)
            with torch.cuda.stream(self.pred):
                self.pred.wait_event(self.scored)
                scores.record_stream(self.pred)
                predict(scores)
                self.pred_done.record(self.pred)

        def speculate():  # Reuse: the speculative pass over P(t), beside the selection on CUDA
            return ops.sparse_attn_partials(q, k_buf, v_buf, b.table, b.seq_lens, st.p_idx,
                                            st.p_cnt, self.page, sm_scale, idx_rows=b.p_cur)

        spec = None
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            self.forked.record(main)  # the selection waits for this point, not for the pass
            if beside:  # the pass and the repair read the new tokens' K/V, the selection not
                store()
            # The previous sparse layer's predictor step (``next``): beside this selection,
            # ahead of this pass, which then overlaps less of the selection's scores.
            deferred, self._deferred = self._deferred, None
            if deferred is not None:
                deferred()
            if self.spec_first:
                spec = speculate()
            with torch.cuda.stream(self.side):
                self.side.wait_event(self.forked)
                if fold:  # the selection reads (and may write with) them on this stream
                    self._keep(new_keys)
                a = select()
                self.selected.record(self.side)
                if not fused and self.predict_at == "selection":
                    predict(a.scores)
                if side_update:  # after the selection: the repair does not wait for it
                    update()
                self.side_done.record(self.side)
        else:
            a = select()
            if not fused:
                predict(a.scores)
        o_s, lse_s = spec if spec is not None else speculate()
        if self.cuda:
            main.wait_event(self.selected)
            for t in (a.a_idx, a.a_cnt, a.m_idx, a.m_cnt):
                t.record_stream(main)  # allocated on the side stream, read on the main one
        m_cnt = torch.zeros_like(a.m_cnt) if self.skip_repair else a.m_cnt
        # Repair over M = A \ P(t), merged with the speculative partials of P(t) n A (exact).
        o, _ = ops.sparse_attn_merge(q, k_buf, v_buf, idx=a.m_idx, cnt=m_cnt, o_spec=o_s,
                                     lse_spec=lse_s, p_idx=st.p_idx, p_cnt=st.p_cnt,
                                     a_idx=a.a_idx, a_cnt=a.a_cnt, nb=b.table.shape[1],
                                     exact=self.exact, p_rows=b.p_cur, **attn)
        if self.cuda and not fused and self.predict_at not in ("selection", "scores"):
            if self.predict_at == "next" and not join:  # at the next sparse layer's fork
                a.scores.record_stream(main)
                self._deferred = lambda: predict(a.scores)
            else:  # beside the layer's next kernels
                self._beside(lambda: predict(a.scores), (), self.side_done)
        if self.cuda and join and (side_update or not fused):
            main.wait_event(self.side_done)
        if early and join:
            main.wait_event(self.pred_done)
        return o

    def _beside(self, fn: Callable[[], None], keep: Sequence[Optional[Tensor]],
                done: "torch.cuda.Event") -> None:
        """``fn`` on the side stream from this point of the main one on (``keep``: the main
        stream's tensors it reads), then ``done`` recorded there for a later join."""
        self.forked.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            self.side.wait_event(self.forked)
            self._keep(keep)
            fn()
            done.record(self.side)

    def _keep(self, tensors: Sequence[Optional[Tensor]]) -> None:
        """Tensors of the main stream (the new keys, the KV store's inputs) that the side stream
        reads too."""
        for t in tensors:
            if t is not None:
                t.record_stream(self.side)
