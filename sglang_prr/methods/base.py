"""The interface of a DSA method, and the compositions every method shares.

A dynamic sparse attention (DSA) method decides which KV blocks a decode query attends. In PRR a
block is one KV page, and a method owns four things, nothing else:

1. a summary of every page, per layer: its tensors' layout (``layout``: shape per page, dtype,
   value of an empty page), hence its bytes per KV token (``bytes_per_token``, which SGLang's KV
   pool gives up) and its allocation (``allocate``);
2. the fold of new keys into the summaries (``update``): a prefill chunk of any length or one
   decode token per request, in place, graph-safe;
3. the block scores of a decode query (``scores``): ``[B, Hk, NB]`` float32, summed over each
   GQA group, ``-inf`` for blocks a request does not have;
4. the decode step's selection (``select``): ``A`` = kept (sink/local) blocks + the top-K middle
   blocks by score, and ``M = A \\ P`` against the prediction ``P``; optionally fused with the
   predictor's step (``select_predict``, ``fuses_predictor``).

The predictor, the speculative attention, the repair and the merge are PRR's and the same for
every method (``step.DecodeStep``). A method composes the public ops (``custom_ops``: kernels on
SM90, the pure-torch reference elsewhere), or plain torch where it has no kernel (such a method
runs its reference everywhere). The registry (``methods/__init__.py``) keys methods by their
``--prr-method`` name; ``tests/unit/test_methods_conformance.py`` runs every registered method
through the same checks.

Shapes: ``B`` requests, ``Hq``/``Hk`` query/KV heads (``G = Hq // Hk``), ``D`` head dim, ``NB``
blocks of the block table, ``P`` pages of the KV pool, ``L`` layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import contracts
from .. import custom_ops as ops
from .. import reference as ref


class SummaryTensor(NamedTuple):
    """One tensor of a method's per-page summary: ``[L, P, *per_page]`` of ``dtype`` in the
    server, ``fill`` in an empty page (e.g. Quest's ``kmin`` starts at ``+inf``)."""

    name: str
    per_page: Tuple[int, ...]
    dtype: torch.dtype
    fill: float


@dataclass(frozen=True)
class SelectSpec:
    """The selection's constants of a decode step, fixed when the step is built (and so for
    every graph shape): K middle blocks, the always-kept sink/local blocks, the width ``n_out``
    of the lists A and M (``>= k + sink + local``; wider when short rows select every block) and
    the page (= block) size in tokens."""

    k: int
    sink_blocks: int
    local_blocks: int
    n_out: int
    page_size: int

    def __post_init__(self):
        contracts.selection("SelectSpec", self.k, self.sink_blocks, self.local_blocks, self.n_out)
        contracts.page_size("SelectSpec", self.page_size)

    @classmethod
    def of(cls, k: int, sink_blocks: int, local_blocks: int, page_size: int,
           n_out: Optional[int] = None) -> "SelectSpec":
        """The spec with ``n_out = k + sink + local`` unless given."""
        n = k + sink_blocks + local_blocks if n_out is None else n_out
        return cls(k=k, sink_blocks=sink_blocks, local_blocks=local_blocks, n_out=n,
                   page_size=page_size)


class NewKeys(NamedTuple):
    """A decode step's new keys, one per request: ``k: [B, Hk, D]`` (rows may be strided), their
    KV slots ``loc: [B]`` and positions ``pos: [B]`` in their requests. ``loc`` None: the
    selection folds the keys into its scores only (the summaries are updated elsewhere)."""

    k: Tensor
    loc: Optional[Tensor]
    pos: Tensor


class Selected(NamedTuple):
    """A decode step's selection: scores ``[B, Hk, NB]`` float32, A and ``M = A \\ P`` as
    ascending ``-1``-padded lists ``[B, Hk, n_out]`` int32 with counts ``[B, Hk]`` int32
    (``M = A`` without P)."""

    scores: Tensor
    a_idx: Tensor
    a_cnt: Tensor
    m_idx: Tensor
    m_cnt: Tensor


def select_from_scores(scores: Tensor, *, nblk: Tensor, nb: int, spec: SelectSpec,
                       p_idx: Optional[Tensor] = None, p_cnt: Optional[Tensor] = None,
                       p_rows: Optional[Tensor] = None, dense_row: Optional[Tensor] = None,
                       stats: Optional[Tensor] = None) -> Selected:
    """A = kept blocks + top-K of ``scores``, ``M = A \\ P`` (``M = A`` without P) and the
    counters added into ``stats``, in one op (``ops.select_lists``: one launch on SM90).
    ``p_rows: [B]``: P is read at those rows of pool-wide lists ``[R, Hk, Np]``;
    ``dense_row: [B]`` bool rows select every block; ``nb``: the table's width, which the
    scores' is. The composition ``reference.select_from_scores`` states on the reference
    alone."""
    _check_width(scores, nb, "select_from_scores")
    lists = ops.select_lists(scores, nblk, p_idx, p_cnt, spec.k, spec.sink_blocks,
                             spec.local_blocks, spec.n_out, p_rows, dense_row, stats)
    return Selected(scores, *lists)


def _check_width(scores: Tensor, nb: int, op: str) -> None:
    """The scores cover the table's ``nb`` blocks a row (the lists index the table)."""
    if scores.shape[-1] != nb:
        raise ValueError(f"{op}: scores has {scores.shape[-1]} blocks a row, expected the "
                         f"table's width nb = {nb}")


class DSAMethod:
    """One DSA method (see the module docstring). Subclasses set ``name`` and implement
    ``layout``, ``from_keys``, ``update`` and ``scores``; ``select`` composes the scores with
    top-K and the set difference unless a method has a fused op for it.

    Class attributes: ``name`` (the ``--prr-method`` value); ``kernels``: the method's ops have
    SM90 kernels (the GPU conformance tests compare them with the reference); ``fuses_predictor``:
    ``select_predict`` is one op that also runs the predictor's step, so with ``--prr-predictor
    fused`` the decode step runs nothing after it (otherwise, and with ``side``, the step runs
    ``ops.predict_update_rows`` as a launch of its own, off the critical path; the composed
    selection's ``select_predict`` is ``select_lists_predict`` after the scores);
    ``predictor_place``: where that launch of its own goes (``step.predictor_placement``:
    ``repair``, after the repair, or ``selection``, right after the selection), as measured for
    the method; ``folds_new_keys``: ``select`` / ``select_predict`` take the step's new
    keys (``new_keys``) and score as if they had been folded into the summaries, whether or not
    ``update`` has run, so the decode step may run the update beside the selection instead of
    before it; ``writes_new_keys`` (with ``folds_new_keys``): given the keys' slots
    (``new_keys.loc``), ``select`` / ``select_predict`` also write the folded summaries, which is
    the decode ``update`` itself, in the selection's launch (the decode step then runs no update).
    """

    name: str = ""
    kernels: bool = False
    fuses_predictor: bool = False
    predictor_place: str = "repair"
    folds_new_keys: bool = False
    writes_new_keys: bool = False

    # ------------------------------------------------------------------ summaries
    def layout(self, page_size: int, num_kv_heads: int, head_dim: int
               ) -> Tuple[SummaryTensor, ...]:
        """The summary tensors of one page (see ``SummaryTensor``), in the order every other
        function of the method takes them."""
        raise NotImplementedError

    def bytes_per_token(self, page_size: int, num_layers: int, num_kv_heads: int,
                        head_dim: int) -> int:
        """Bytes of summaries per KV token over all layers (added to SGLang's KV cell size),
        rounded up: exactly ``allocate``'s bytes over ``page_size`` tokens per page."""
        per_page = sum(math.prod(t.per_page) * t.dtype.itemsize
                       for t in self.layout(page_size, num_kv_heads, head_dim))
        return int(math.ceil(num_layers * per_page / page_size))

    def summary_dtypes(self, page_size: int) -> str:
        """The dtypes of ``layout``'s tensors, comma-joined (Quest: ``bfloat16,bfloat16``): a
        budget profile records them with its layer shape, since the selection's time follows
        its summaries' bytes (InfLLM-v2's compressed keys are bf16 or float32 by
        ``SGLANG_PRR_INFLLM_CK``)."""
        return ",".join(str(t.dtype).replace("torch.", "") for t in self.layout(page_size, 1, 1))

    def allocate(self, num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int,
                 page_size: int, device) -> List[Tensor]:
        """Every layer's summaries of every page, empty: ``[L, P, *per_page]`` per tensor of
        ``layout``. Layer ``l``'s summary is ``[t[l] for t in tensors]``."""
        return [torch.full((num_layers, num_pages) + tuple(t.per_page), t.fill, dtype=t.dtype,
                           device=device)
                for t in self.layout(page_size, num_kv_heads, head_dim)]

    def from_keys(self, k_pages: Tensor) -> List[Tensor]:
        """One layer's summaries of whole pages of keys ``k_pages: [P, page, Hk, D]`` (synthetic
        inputs, benchmarks), in ``layout``'s shapes and dtypes."""
        raise NotImplementedError

    def update(self, summary: Sequence[Tensor], k: Tensor, out_loc: Tensor, positions: Tensor,
               page_size: int, *, decode: bool, key_buffer: Tensor, req_to_token: Tensor,
               token_req_idx: Callable[[], Tensor]) -> None:
        """Fold the new keys ``k: [N, Hk, D]`` at slots ``out_loc: [N]`` and request positions
        ``positions: [N]`` into one layer's ``summary`` (``[P, *per_page]`` tensors), in place.
        A page is reset when its first position is written (a reused page forgets its previous
        owner). ``decode``: one token per request, each in its own page. ``key_buffer: [slots,
        Hk, D]`` is the layer's K pool with the new keys already written, ``req_to_token`` SGLang's
        ``[R, max_ctx]`` slot table and ``token_req_idx()`` each token's request slot ``[N]``
        (built on demand: only methods that re-read the pool call it)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ scores and selection
    def scores(self, q: Tensor, summary: Sequence[Tensor], *, table: Tensor, seq_lens: Tensor,
               page_size: int, sm_scale: float, nblk: Optional[Tensor] = None) -> Tensor:
        """Block scores ``[B, Hk, NB]`` float32 of the queries ``q: [B, Hq, D]`` over the blocks
        of ``table: [B, NB]`` (page ids), summed over each GQA group; ``-inf`` for blocks past a
        request (``seq_lens: [B]`` tokens, the decoded one included; ``nblk: [B]`` its blocks,
        ``ceil(seq_lens / page_size)`` when not given)."""
        raise NotImplementedError

    def select(self, q: Tensor, summary: Sequence[Tensor], *, table: Tensor, seq_lens: Tensor,
               spec: SelectSpec, sm_scale: float, nblk: Optional[Tensor] = None,
               p_idx: Optional[Tensor] = None, p_cnt: Optional[Tensor] = None,
               p_rows: Optional[Tensor] = None, dense_row: Optional[Tensor] = None,
               stats: Optional[Tensor] = None, new_keys: Optional[NewKeys] = None,
               on_scores: Optional[Callable[[Tensor], None]] = None) -> Selected:
        """The decode step's selection: ``scores``, then ``select_from_scores`` (A, M = A \\ P,
        the counters). Arguments as in ``scores`` and ``select_from_scores``; ``new_keys`` only
        where the method ``folds_new_keys``; ``on_scores(scores)``, where given, is called as
        soon as the scores exist and before anything else is launched (a composed selection
        calls it between its two ops, a one-launch selection after it): the decode step forks
        the predictor's step there."""
        nblk = ref.num_blocks(seq_lens, spec.page_size) if nblk is None else nblk
        s = self._step_scores(q, summary, table, seq_lens, spec, sm_scale, nblk, new_keys)
        if on_scores is not None:
            on_scores(s)
        return select_from_scores(s, nblk=nblk, nb=table.shape[1], spec=spec, p_idx=p_idx,
                                  p_cnt=p_cnt, p_rows=p_rows, dense_row=dense_row, stats=stats)

    def select_predict(self, q: Tensor, summary: Sequence[Tensor], *, table: Tensor,
                       seq_lens: Tensor, nblk: Tensor, nblk_next: Tensor, spec: SelectSpec,
                       sm_scale: float, state, rows: Tensor, p_rows: Tensor,
                       p_next_rows: Tensor, n_pred: int, dense_row: Optional[Tensor] = None,
                       stats: Optional[Tensor] = None,
                       new_keys: Optional[NewKeys] = None) -> Selected:
        """A PRR decode step's selection against P(t) at rows ``p_rows`` of the layer's pool-wide
        predictor ``state`` (``step.LayerState``: p_idx, p_cnt, level, trend, n_init, theta),
        then the predictor's step on state rows ``rows: [B]``: the Holt update with this step's
        scores and P(t+1) (``n_pred`` middle blocks) written at rows ``p_next_rows``, which are
        not rows ``p_rows`` (the decode step's double buffer of P). The composed selection:
        ``scores``, then ``ops.select_lists_predict`` (the lists and the predictor's step in one
        op, one launch on SM90); a method with a selection of its own overrides it with the same
        result as ``select`` then ``ops.predict_update_rows``."""
        st = state
        s = self._step_scores(q, summary, table, seq_lens, spec, sm_scale, nblk, new_keys)
        _check_width(s, table.shape[1], "select_predict")
        lists = ops.select_lists_predict(
            s, nblk, nblk_next, st.p_idx, st.p_cnt, p_rows, p_next_rows, st.level, st.trend,
            st.n_init, st.theta, rows, spec.k, n_pred, spec.sink_blocks, spec.local_blocks,
            spec.n_out, dense_row, stats)
        return Selected(s, *lists)

    def _step_scores(self, q: Tensor, summary: Sequence[Tensor], table: Tensor,
                     seq_lens: Tensor, spec: SelectSpec, sm_scale: float, nblk: Tensor,
                     new_keys: Optional[NewKeys]) -> Tensor:
        """A composed selection's first op: ``scores`` of the step (no new keys to fold)."""
        self._no_new_keys(new_keys)
        return self.scores(q, summary, table=table, seq_lens=seq_lens,
                           page_size=spec.page_size, sm_scale=sm_scale, nblk=nblk)

    def _no_new_keys(self, new_keys: Optional[NewKeys]) -> None:
        if new_keys is not None and not self.folds_new_keys:
            raise ValueError(f"{self.name}: new_keys given, but the method does not fold new "
                             "keys into its selection (folds_new_keys is False): run its update "
                             "before the selection instead")

    def __repr__(self) -> str:
        return f"<DSA method {self.name!r}>"
