"""PRR attention backend: wraps SGLang's attention backend; extend = calibrate, decode = PRR.

Decode, per layer (``forward_decode``):

1. write the new K/V into SGLang's pool (the same ``set_kv_buffer`` the inner backend uses),
   then fold the new key into its page's block summary (``ops.quest_update`` /
   ``ops.infllm_update``);
2. layers in ``dense_layers``: the inner backend's dense attention;
3. every other layer: ``step.DecodeStep.run``, serial DSA (``--prr-serial``, or a batch size
   where the ``--prr-budget auto`` profile says speculation does not pay: ``budget.py``) or PRR,
   on the request pool's predictor state in place. Rows shorter than ``min_context`` take the same
   kernels with every block selected, so the inner backend never attends in these layers (it is
   planned with one-token rows, see ``_dense_batch``);
4. a batch size that the ``--prr-budget auto`` profile runs dense (dense attention measured
   faster than the sparse step there): the inner backend attends, planned with the real lengths,
   and only the summaries are kept up to date (a request may decode sparse later). When the
   profile runs every batch size dense (``BudgetPolicy.always_dense``: a short server, a small
   model), no request ever decodes sparse and the summaries are not updated either: the server's
   attention is the inner backend's, launch for launch.

The per-forward values (block table, block counts, dense rows) are planned once per forward in
SGLang's ``init_forward_metadata_in_graph`` hook (recorded into decode CUDA graphs) or, eagerly,
in ``init_forward_metadata``. Nothing in the decode path reads a device value on the host: shapes
are static (block lists are ``-1`` padded with device-side counts) and the statistics are
counted on the device by the selection kernel.

Extend (``forward_extend``): the inner backend's attention, then the summaries of the new
tokens, then calibration (``calibration.Calibrator``) on ``calib_queries`` queries sampled
evenly from the chunk of each request that will decode sparse (at least ``min_context`` tokens
after the chunk, read from the host lengths; shorter requests are skipped): every candidate of
``cfg.theta_grid`` is scored, the scores accumulate over the chunks of a chunked prefill,
theta* = argmax per request and layer; the predictor is replayed over the sampled queries with
theta* and predicts P for the first decode step. Off when no batch size ever speculates.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from typing import List, Optional

import torch

from .. import ops
from ..budget import BudgetPolicy, layer_shape
from ..calibration import Calibrator
from ..config import PRRConfig
from ..methods import NewKeys
from ..state import PRRState
from ..step import DecodeStep
from ..summaries import BlockSummaries
from .server_args_patch import max_decode_batch_of
from .stats import Stats, write_fallback

logger = logging.getLogger("sglang_prr")

# Debug switch for negative controls: PRR without its repair step (M forced empty). The exactness
# tests use it to show that the repair is what makes PRR(exact) equal serial DSA.
ENV_SKIP_REPAIR = "SGLANG_PRR_DEBUG_SKIP_REPAIR"


def wrap_backend(inner, runner, name: str):
    """Called by the patched registry: PRRBackend around ``inner`` when PRR is configured."""
    from .server_args_patch import load_config

    cfg = load_config()
    if cfg is None or not cfg.enabled:
        return inner
    if isinstance(inner, PRRBackend):
        return inner
    return PRRBackend(inner, runner, cfg, name)


def _attn_tp_size() -> int:
    """Attention tensor-parallel size (1 without a parallel context, e.g. outside a server)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_size)
    except Exception:
        return 1


class PRRBackend:
    """Wraps an SGLang ``AttentionBackend``; see the module docstring. Every attribute not
    defined here (CUDA-graph hooks, flags) is the inner backend's."""

    def __init__(self, inner, runner, cfg: PRRConfig, name: str):
        self.inner = inner
        self.cfg = cfg
        self.name = name
        self.runner = runner
        self.device = torch.device(runner.device)
        self.page = int(runner.server_args.page_size or 1)
        self.kv_pool = runner.token_to_kv_pool
        self.req_pool = runner.req_to_token_pool
        self.active = True
        self._warned = False
        # True where no layer does more than the inner backend: PRR cannot serve the model, or
        # every batch size decodes dense and no summary is kept. ``forward`` then hands every
        # layer straight to the inner backend (a decode step without a CUDA graph took ~3 µs of
        # host time a layer in the wrapper's checks, for nothing).
        self.passthrough = True
        # Host and device tensors of ones by (batch size, dtype, device), for ``_dense_batch``.
        self._ones = {}
        reason = self._incompatible(runner)
        if reason:
            self.active = False
            logger.warning("sglang_prr: %s; PRR falls back to dense attention", reason)
            write_fallback(cfg, reason)
            return
        mc = runner.model_config
        tp = _attn_tp_size()
        self.num_kv_heads = mc.get_num_kv_heads(tp)
        self.head_dim = mc.head_dim
        self.num_layers = mc.num_hidden_layers
        kbuf = self.kv_pool.get_key_buffer(getattr(self.kv_pool, "start_layer", 0) or 0)
        self.num_pages = kbuf.shape[0] // self.page
        L, P, Hk, D = self.num_layers, self.num_pages, self.num_kv_heads, self.head_dim
        self.k_blocks = cfg.top_k_blocks
        self.n_pred = cfg.predicted_blocks
        # Speculate or not, and over how many blocks, per decode batch size (--prr-budget auto:
        # from the profile, checked against this layer shape).
        shape = layer_shape(cfg, self.page, D, Hk, mc.get_num_attention_heads(tp)
                            if hasattr(mc, "get_num_attention_heads") else None)
        self.budget = BudgetPolicy(cfg, shape, max_decode_batch_of(runner))
        # Calibration, the side stream and the PRR statistics only serve speculation: all off
        # when no batch size ever speculates.
        self.calibrates = self.budget.may_speculate()
        # Block summaries serve the sparse step only: none is written when every batch size runs
        # dense (their memory stays allocated).
        self.keeps_summaries = not self.budget.always_dense()
        self.passthrough = not self.keeps_summaries
        # One model runner may build several backends (separate prefill and decode backends):
        # they share one set of summaries, state and statistics, kept on the runner.
        shared = getattr(runner, "_prr_shared", None)
        if shared is None:
            shared = {"state": PRRState(cfg, L, Hk, self.req_pool, self.device),
                      "stats": Stats(self.device, cfg, runner.server_args, self.calibrates)}
            shared["summaries"] = BlockSummaries(cfg.method, L, P, Hk, D, self.page, self.device)
            try:
                runner._prr_shared = shared
            except AttributeError:
                pass
        self.summaries = shared["summaries"]
        self.state = shared["state"]
        # Prefill calibration (eqs 4-5): sampled in every sparse layer, run after the last one.
        self.calibrator = Calibrator(cfg, self.state, shared["stats"], self.page, self.device)
        self.dense_layers = set(cfg.dense_layers)
        self.sparse_layers = sum(1 for i in range(self.num_layers) if i not in self.dense_layers)
        # The side stream of PRR joins the main one after this layer (None: after every layer).
        self._join_layer = self._last_sparse_layer()
        self.step = _decode_step(runner, cfg, self.device, self.budget, self.calibrates)
        if self.device.type == "cuda":
            # Build/load the SM90 kernels now, not in the first decode step or a graph capture
            # (falls back to the reference with one warning on other GPUs or a failed build).
            from .. import kernels

            kernels.load()
        self.stats = shared["stats"]
        self.stats.budget = self.budget.describe()
        self.stats.budget_reason = self.budget.reasons()
        if cfg.budget == "auto" and not cfg.serial:
            logger.info("sglang_prr: --prr-budget auto from %s: delta per batch size %s (0: "
                        "serial DSA)%s", cfg.profile, self.stats.budget,
                        "" if self.calibrates else "; no batch size speculates, calibration off")
            for b, why in self.stats.budget_reason.items():
                logger.info("sglang_prr: budget at batch size %s: %s", b, why)
            if not self.keeps_summaries:
                logger.info("sglang_prr: every batch size of this server (at most %s requests a "
                            "step) decodes with dense attention: no block summary is updated "
                            "(the inner backend's attention, launch for launch)",
                            self.budget.max_batch)
        self.tracer = self._make_tracer()
        self._ext_plan = None
        summary_mib = self.summaries.nbytes / 2**20
        logger.info("sglang_prr: PRRBackend(%s) method=%s mode=%s%s K=%d blocks |P|<=%d "
                    "page=%d pages=%d summaries=%.1f MiB state=%.1f MiB", name, cfg.method,
                    cfg.mode, " serial" if cfg.serial else "", self.k_blocks, self.n_pred,
                    self.page, self.num_pages, summary_mib, self.state.nbytes / 2**20)

    # ------------------------------------------------------------------ plumbing
    def __getattr__(self, item):
        # Only reached for attributes not found normally: delegate to the wrapped backend.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(item)
        return getattr(inner, item)

    def _incompatible(self, runner) -> Optional[str]:
        if getattr(runner, "use_mla_backend", False):
            return "MLA models are not supported"
        mc = runner.model_config
        if getattr(runner, "sliding_window_size", None) or getattr(mc, "is_hybrid_swa", False):
            return "sliding-window attention models are not supported"
        if self.page != self.cfg.block_size:
            return f"page size {self.page} != PRR block size {self.cfg.block_size}"
        if getattr(mc, "attention_arch", None) is not None and "MLA" in str(mc.attention_arch):
            return "MLA models are not supported"
        return None

    def _last_sparse_layer(self) -> Optional[int]:
        """The last layer whose decode runs PRR, when this process runs every layer (then PRR's
        side stream joins once per forward, after that layer); None with pipeline parallelism or
        no sparse layer (it joins after every layer)."""
        start = getattr(self.kv_pool, "start_layer", 0) or 0
        end = getattr(self.kv_pool, "end_layer", None)
        n = getattr(self.kv_pool, "layer_num", None)  # KV layers; differs with extra layers
        # SGLang's model runner hands the pool the model's end_layer, exclusive (num_layers when
        # this process runs every layer); KVCache's own default is inclusive (num_layers - 1).
        # Both mean the last layer. Accepting only the inclusive one made every server calibrate
        # (and join the side stream) after each layer, ~L times the launches (issue 10).
        if (start != 0 or end not in (None, self.num_layers - 1, self.num_layers)
                or n not in (None, self.num_layers)):
            return None
        ids = [i for i in range(self.num_layers) if i not in self.dense_layers]
        return ids[-1] if ids else None

    def _make_tracer(self):
        if not self.cfg.trace_path:
            return None
        try:
            from ..tools.traces import TraceRecorder
        except ImportError:
            logger.warning("sglang_prr: --prr-trace-path given but tools.traces is missing")
            return None
        return TraceRecorder(self.cfg, self.num_layers, self.num_kv_heads)

    def _summary(self, layer_id: int) -> List[torch.Tensor]:
        return self.summaries.layer(layer_id)

    def support_triton(self):
        return self.inner.support_triton()

    def get_cuda_graph_seq_len_fill_value(self):
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def init_cuda_graph_state(self, *args, **kwargs):
        return self.inner.init_cuda_graph_state(*args, **kwargs)

    # ------------------------------------------------------------------ per-forward host work
    def _before_forward(self, fb) -> None:
        """Host bookkeeping at the start of a forward (never inside a captured graph)."""
        if not self.active:
            return
        # Flush first: the snapshot then holds whole forwards only (this batch's host row counts
        # join the device sums of its layers, which have not run yet).
        self.stats.maybe_flush()
        mode = fb.forward_mode
        if mode.is_extend():
            if not self.passthrough:  # (no layer reads the predictor state)
                self.state.apply_resets()
            self.stats.extend_batches += 1
            self._ext_plan = None
        elif mode.is_decode():
            self.stats.decode_batches += 1
            lens = getattr(fb, "seq_lens_cpu", None)
            if lens is not None:
                bs = int(lens.shape[0])  # the graph's batch size (padding rows included)
                real = bs - int(getattr(fb, "num_padding", 0) or 0)
                self.stats.count_batch(lens, real, self.cfg.min_context, self.sparse_layers,
                                       self.budget.delta(bs) > 0, dense=self.budget.dense(bs))

    def init_forward_metadata(self, fb):
        self._before_forward(fb)
        out = self.inner.init_forward_metadata(self._dense_batch(fb))
        self._plan_decode(fb)
        return out

    def init_forward_metadata_in_graph(self, fb):
        # Recorded into decode CUDA graphs: the capture records the plan's launches itself.
        out = self.inner.init_forward_metadata_in_graph(fb)
        self._plan_decode(fb)
        return out

    def _runs_dense(self, fb) -> bool:
        """Whether this decode forward's batch size runs dense attention (``BudgetPolicy.dense``;
        the batch size as the graph was captured for it: padding rows included)."""
        return fb.forward_mode.is_decode() and self.budget.dense(int(fb.seq_lens.shape[0]))

    def _plan_decode(self, fb) -> None:
        """The per-forward values of the decode step, kept on the batch for its layers."""
        if self.active and fb.forward_mode.is_decode() and not self._runs_dense(fb):
            fb._prr_batch = self.step.plan(self.req_pool.req_to_token, fb.req_pool_indices,
                                           fb.seq_lens)

    def init_forward_metadata_out_graph(self, fb, in_capture: bool = False):
        if not in_capture:
            self._before_forward(fb)
            fb = self._dense_batch(fb)
        return self.inner.init_forward_metadata_out_graph(fb, in_capture=in_capture)

    def _dense_batch(self, fb):
        """``fb`` as the inner backend plans it for a decode step: every row attends over one
        token, since no layer asks the inner backend to attend (``DecodeStep`` serves every row,
        short ones included), so FlashInfer's planning stays cheap at long context. ``fb``
        itself when the inner backend does attend: other modes, PRR inactive, whole dense layers
        (``--prr-dense-layers`` needs every row's dense attention), no host lengths."""
        lens_cpu = getattr(fb, "seq_lens_cpu", None)
        if (not self.active or self.dense_layers or lens_cpu is None
                or not fb.forward_mode.is_decode() or self._runs_dense(fb)):
            return fb
        view = copy.copy(fb)
        view.seq_lens = self._ones_like(fb.seq_lens)
        view.seq_lens_cpu = self._ones_like(lens_cpu)
        view.seq_lens_sum = int(lens_cpu.shape[0])
        return view

    def _ones_like(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of ones of ``t``'s shape, dtype and device, made once per batch size: the
        inner backend only reads it, and a new one every step cost a fill kernel launch on the
        device and ~10 µs of host time (``bench_host_step.py``)."""
        key = (tuple(t.shape), t.dtype, t.device)
        ones = self._ones.get(key)
        if ones is None:
            ones = self._ones[key] = torch.ones_like(t)
        return ones

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if self.passthrough:
            return self.inner.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        if mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if mode.is_mixed() and hasattr(self.inner, "forward_mixed") and not mode.is_extend():
            return self.inner.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    # ------------------------------------------------------------------ summaries
    def _update_summaries(self, layer_id: int, k: torch.Tensor, fb) -> None:
        if not self.keeps_summaries:
            return
        # Decode writes one token per request, each into its own last page.
        self.summaries.update(layer_id, k.reshape(-1, self.num_kv_heads, self.head_dim),
                              fb.out_cache_loc, fb.positions, fb.forward_mode.is_decode(),
                              self.kv_pool.get_key_buffer(layer_id), self.req_pool.req_to_token,
                              lambda: self._token_req_idx(fb))

    def _token_req_idx(self, fb) -> torch.Tensor:
        """Request slot of every token of the batch ``[N]`` (decode: one token per request)."""
        if fb.forward_mode.is_decode():
            return fb.req_pool_indices
        lens = fb.extend_seq_lens
        return torch.repeat_interleave(fb.req_pool_indices, lens, output_size=int(fb.out_cache_loc.shape[0]))

    def _applies(self, layer) -> bool:
        return (self.active and not getattr(layer, "is_cross_attention", False)
                and layer.layer_id not in self.dense_layers)

    # ------------------------------------------------------------------ extend
    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        o = self.inner.forward_extend(q, k, v, layer, fb, save_kv_cache=save_kv_cache, **kwargs)
        if not self._applies(layer) or k is None:
            return o
        self._update_summaries(layer.layer_id, k, fb)
        if self.cfg.calib_queries >= 2 and self.calibrates:
            self._calib_sample(layer, q, fb)
            # Calibrate every layer of the forward together after its last sparse layer (per
            # layer when this process does not run every layer, e.g. pipeline parallelism).
            if self._join_layer in (None, layer.layer_id):
                self._calib_run()
        return o

    def _extend_plan(self, fb):
        """This forward's calibration plan (``Calibrator.plan``: the sampled queries of each
        request, the same for every layer), made at its first sparse layer; ``_before_forward``
        drops it at the start of every extend forward."""
        if self._ext_plan is None:
            self._ext_plan = self.calibrator.plan(self.req_pool.req_to_token,
                                                  fb.req_pool_indices, fb.extend_seq_lens_cpu,
                                                  fb.extend_prefix_lens_cpu)
        return self._ext_plan

    def _calib_sample(self, layer, q, fb) -> None:
        """Block scores of the sampled queries of this layer, kept until ``_calib_run``."""
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        self.calibrator.sample(self._extend_plan(fb), layer.layer_id, q3,
                               self._summary(layer.layer_id), layer.scaling)

    def _calib_run(self) -> None:
        """Eqs 4-5 for every sampled layer of each request at once; see ``Calibrator.run``."""
        if self._ext_plan is not None:
            self.calibrator.run(self._ext_plan)

    # ------------------------------------------------------------------ decode
    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        if not self._applies(layer):
            return self.inner.forward_decode(q, k, v, layer, fb, save_kv_cache=save_kv_cache,
                                             **kwargs)
        if self._runs_dense(fb):  # the inner backend attends (it writes the KV first)
            o = self.inner.forward_decode(q, k, v, layer, fb, save_kv_cache=save_kv_cache,
                                          **kwargs)
            if k is not None:
                self._update_summaries(layer.layer_id, k, fb)
            return o
        cfg, l = self.cfg, layer.layer_id
        Hq, D, Dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        B = fb.seq_lens.shape[0]
        # 1. KV write (the inner backend's store), placed by the step (``DecodeStep.run``).
        store = (functools.partial(self.kv_pool.set_kv_buffer, layer, fb.out_cache_loc, k, v)
                 if save_kv_cache and k is not None and v is not None else None)
        # 2. The sparse step, for every row (short rows attend every block), with the summary
        # update of the new token (the step places it: in Quest's selection, which writes it;
        # first; or beside the selection). Padded graph rows have out_cache_loc 0: page 0.
        batch = getattr(fb, "_prr_batch", None)
        if batch is None:  # a path that skipped the metadata hooks: plan here (eager only)
            self._plan_decode(fb)
            batch = fb._prr_batch
        q3 = q.reshape(B, Hq, D)  # a view: rows may be strided (the fused qkv), heads packed
        summary = self._summary(l)
        new_keys = update = None
        if k is not None and self.keeps_summaries:
            new_keys = NewKeys(k.reshape(B, self.num_kv_heads, self.head_dim), fb.out_cache_loc,
                               fb.positions)
            update = functools.partial(self._update_summaries, l, k, fb)
        traced = self.tracer is not None and self.tracer.wants(l)
        o = self.step.run(q3, self.kv_pool.get_key_buffer(l), self.kv_pool.get_value_buffer(l),
                          summary, batch, None if cfg.serial else self.state.layer(l),
                          self.stats.counters, layer.scaling, q.dtype,
                          join=traced or self._join_layer in (None, l), new_keys=new_keys,
                          update=update, store=store, keep=(fb.out_cache_loc, k, v))
        if traced:  # (joined above: the trace reads the updated summaries)
            scores = ops.select_blocks(cfg.method, q3, summary, batch.table, batch.seq_lens,
                                       self.page, layer.scaling)
            rids = list(getattr(fb, "rids", None) or [str(i) for i in range(B)])
            self.tracer.record(l, rids, scores, batch.nblk)
        return o.reshape(B, Hq * Dv)


def _decode_step(runner, cfg: PRRConfig, device: torch.device, budget: BudgetPolicy,
                 speculates: bool) -> DecodeStep:
    """The runner's ``DecodeStep`` (one per model runner: its side stream and events are shared
    by the runner's backends, whose layers run in order)."""
    step = getattr(runner, "_prr_step", None)
    if step is None:
        step = DecodeStep(cfg.method, cfg.top_k_blocks, cfg.predicted_blocks, cfg.sink_blocks,
                          cfg.local_blocks, cfg.block_size, cfg.min_context,
                          exact=cfg.mode == "exact", serial=not speculates,
                          device=device, skip_repair=os.environ.get(ENV_SKIP_REPAIR) == "1",
                          budget=budget.predicted_blocks if budget.profile else None,
                          fuse_predictor=cfg.predictor == "fused")
        try:
            runner._prr_step = step
        except AttributeError:
            pass
    return step
