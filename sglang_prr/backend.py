"""PRR attention backend: wraps SGLang's attention backend; extend = calibrate, decode = PRR.

Decode, per layer (``forward_decode``):

1. write the new K/V into SGLang's pool (the same ``set_kv_buffer`` the inner backend uses),
   then fold the new key into its page's block summary (``ops.quest_update`` /
   ``ops.infllm_update``);
2. layers in ``dense_layers``: the inner backend's dense attention;
3. every other layer: ``step.DecodeStep.run``, serial DSA (``--prr-serial``) or PRR, on the
   request pool's predictor state in place. Rows shorter than ``min_context`` take the same
   kernels with every block selected, so the inner backend never attends in these layers (it is
   planned with one-token rows, see ``_dense_batch``).

The per-forward values (block table, block counts, dense rows) are planned once per forward in
SGLang's ``init_forward_metadata_in_graph`` hook (recorded into decode CUDA graphs) or, eagerly,
in ``init_forward_metadata``. Nothing in the decode path reads a device value on the host: shapes
are static (block lists are ``-1`` padded with device-side counts) and the statistics are
counted on the device by the selection kernel.

Extend (``forward_extend``): the inner backend's attention, then the summaries of the new
tokens, then calibration on ``calib_queries`` queries sampled evenly from each request's chunk:
``ops.calibrate`` scores every candidate of ``cfg.theta_grid``, the scores accumulate over the
chunks of a chunked prefill, theta* = argmax per request and layer; the predictor is replayed
over the sampled queries with theta* and predicts P for the first decode step.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from . import ops
from . import reference as ref
from .config import PRRConfig
from .state import PRRState
from .step import DecodeStep

logger = logging.getLogger("sglang_prr")

# Debug switch for negative controls: PRR without its repair step (M forced empty). The exactness
# tests use it to show that the repair is what makes PRR(exact) equal serial DSA.
ENV_SKIP_REPAIR = "SGLANG_PRR_DEBUG_SKIP_REPAIR"
# On a GPU the statistics file is refreshed at most this often (a device->host copy).
STATS_FLUSH_SECONDS_GPU = 1.0

# Device counters of the selection kernel (int64): |A|, |M|, |P| summed over the sparse
# (request, KV head) rows of every layer-step, and the number of such rows.
_S_A, _S_M, _S_P, _S_ROWS = range(4)
_N_STATS = 4


def wrap_backend(inner, runner, name: str):
    """Called by the patched registry: PRRBackend around ``inner`` when PRR is configured."""
    from .server_args_patch import load_config

    cfg = load_config()
    if cfg is None or not cfg.enabled:
        return inner
    if isinstance(inner, PRRBackend):
        return inner
    return PRRBackend(inner, runner, cfg, name)


class _Stats:
    """Counters: the device's are drained to the host only outside the decode step."""

    def __init__(self, device, cfg: PRRConfig, server_args):
        # Written by the selection kernel; drained (read, then zeroed) at each flush, so the
        # int64 sums never come near overflow and the host keeps exact Python ints.
        self.counters = torch.zeros(_N_STATS, dtype=torch.int64, device=device)
        self.totals = [0] * _N_STATS
        self.cfg = cfg
        self.decode_batches = 0
        # Host counts, from the batch's host lengths (no device work in the decode step): layer-
        # steps of the sparse path, rows shorter than min_context (all blocks attended).
        self.decode_steps = 0
        self.dense_rows = 0
        self.extend_batches = 0
        self.calibrations = 0
        self.theta_counts: Dict[str, int] = {}
        self._last_flush = 0.0
        self._last_logged = 0
        self._gauges = None
        self._enable_metrics = bool(getattr(server_args, "enable_metrics", False))
        self._on_gpu = torch.device(device).type == "cuda"

    def drain(self) -> None:
        """Move the device counters to the host totals (host-ok: called from
        init_forward_metadata, outside decode; the read waits for the steps already queued)."""
        for i, x in enumerate(self.counters.tolist()):  # host-ok: outside decode
            self.totals[i] += int(x)
        self.counters.zero_()

    def snapshot(self) -> Dict[str, Any]:
        self.drain()
        a = self.totals
        rows = a[_S_ROWS]
        # Serial DSA predicts nothing: its hit rate and budget are not applicable (None).
        prr = not self.cfg.serial and a[_S_A] > 0
        return {
            "decode_batches": self.decode_batches,
            "decode_steps": self.decode_steps,
            "sparse_rows": rows,
            "dense_rows": self.dense_rows,
            "hit_rate": ((a[_S_A] - a[_S_M]) / a[_S_A]) if prr else None,
            "mean_selected_blocks": a[_S_A] / rows if rows else None,
            "mean_repair_blocks": a[_S_M] / rows if rows and not self.cfg.serial else None,
            "delta": (a[_S_P] / a[_S_A]) if prr else None,
            "extend_batches": self.extend_batches,
            "calibrations": self.calibrations,
            "theta_chosen": dict(self.theta_counts),
            "time": time.time(),
        }

    def count_batch(self, lens_cpu, real_rows: int, min_context: int, sparse_layers: int) -> None:
        """Host counts of one decode batch: its first ``real_rows`` host lengths (the rest is
        CUDA-graph padding) split at ``min_context`` like the decode step splits them."""
        lens = lens_cpu[:real_rows]
        n_sparse = int((lens >= min_context).sum())
        if n_sparse == 0:
            return
        self.decode_steps += sparse_layers
        self.dense_rows += sparse_layers * (real_rows - n_sparse)

    def maybe_flush(self, force: bool = False) -> None:
        now = time.time()
        interval = self.cfg.metrics_interval
        log_due = interval > 0 and self.decode_batches - self._last_logged >= interval
        if not (force or log_due or not self._on_gpu
                or now - self._last_flush >= STATS_FLUSH_SECONDS_GPU):
            return
        self._last_flush = now
        snap = self.snapshot()
        from .plugin import stats_path

        path = stats_path()
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(snap, f)
            os.replace(tmp, path)
        except OSError as e:
            logger.debug("sglang_prr: cannot write stats (%s)", e)
        if log_due:
            self._last_logged = self.decode_batches
            logger.info("PRR decode batches=%d hit_rate=%s |A|=%s |M|=%s delta=%s",
                        snap["decode_batches"], _fmt(snap["hit_rate"]),
                        _fmt(snap["mean_selected_blocks"]), _fmt(snap["mean_repair_blocks"]),
                        _fmt(snap["delta"]))
        if self._enable_metrics:
            self._export(snap)

    def _export(self, snap) -> None:
        try:
            from prometheus_client import Gauge

            if self._gauges is None:
                mk = lambda n, d: Gauge(f"sglang:prr_{n}", d, multiprocess_mode="mostrecent")
                self._gauges = {
                    "hit_rate": mk("hit_rate", "PRR hit rate |P n A| / |A| (cumulative)"),
                    "mean_repair_blocks": mk("repair_blocks", "Mean |M| per row, head, layer"),
                    "mean_selected_blocks": mk("selected_blocks", "Mean |A| per row, head, layer"),
                    "delta": mk("delta", "Speculation budget used: |P| / |A|"),
                    "decode_steps": mk("decode_steps", "PRR layer-steps run (cumulative)"),
                }
            for k, g in self._gauges.items():
                if snap.get(k) is not None:
                    g.set(float(snap[k]))
        except Exception as e:  # metrics must never break serving
            logger.debug("sglang_prr: prometheus export failed (%s)", e)


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"


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
        reason = self._incompatible(runner)
        if reason:
            self.active = False
            logger.warning("sglang_prr: %s; PRR falls back to dense attention", reason)
            return
        mc = runner.model_config
        try:
            from sglang.srt.runtime_context import get_parallel

            tp = get_parallel().attn_tp_size
        except Exception:  # no parallel context (a backend built outside a server)
            tp = 1
        self.num_kv_heads = mc.get_num_kv_heads(tp)
        self.head_dim = mc.head_dim
        self.num_layers = mc.num_hidden_layers
        kbuf = self.kv_pool.get_key_buffer(getattr(self.kv_pool, "start_layer", 0) or 0)
        self.num_pages = kbuf.shape[0] // self.page
        L, P, Hk, D = self.num_layers, self.num_pages, self.num_kv_heads, self.head_dim
        # One model runner may build several backends (separate prefill and decode backends):
        # they share one set of summaries, state and statistics, kept on the runner.
        shared = getattr(runner, "_prr_shared", None)
        if shared is None:
            shared = {"state": PRRState(cfg, L, Hk, self.req_pool, self.device),
                      "stats": _Stats(self.device, cfg, runner.server_args)}
            if cfg.method == "quest":
                shared["kmin"] = torch.full((L, P, Hk, D), float("inf"), device=self.device)
                shared["kmax"] = torch.full((L, P, Hk, D), float("-inf"), device=self.device)
            else:
                shared["ck"] = torch.zeros((L, P, self.page // 16, Hk, D), device=self.device)
            try:
                runner._prr_shared = shared
            except AttributeError:
                pass
        for key in ("kmin", "kmax", "ck"):
            if key in shared:
                setattr(self, key, shared[key])
        self.state = shared["state"]
        grid = torch.tensor(cfg.theta_grid, dtype=torch.float32, device=self.device)  # [C, 3]
        self.grid = grid
        self.alphas, self.betas, self.gammas = (grid[:, i].contiguous() for i in range(3))
        self.k_blocks = cfg.top_k_blocks
        self.n_pred = cfg.predicted_blocks
        self.dense_layers = set(cfg.dense_layers)
        self.sparse_layers = sum(1 for i in range(self.num_layers) if i not in self.dense_layers)
        # The side stream of PRR joins the main one after this layer (None: after every layer).
        self._join_layer = self._last_sparse_layer()
        self.step = _decode_step(runner, cfg, self.device)
        if self.device.type == "cuda":
            # Build/load the SM90 kernels now, not in the first decode step or a graph capture
            # (falls back to the reference with one warning on other GPUs or a failed build).
            from . import kernels

            kernels.load()
        self.stats = shared["stats"]
        self.tracer = self._make_tracer()
        self._ext_plan = None
        summary_mib = sum(t.numel() * 4 for t in self._summary_tensors()) / 2**20
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
        if start != 0 or end not in (None, self.num_layers - 1) or n not in (None, self.num_layers):
            return None
        ids = [i for i in range(self.num_layers) if i not in self.dense_layers]
        return ids[-1] if ids else None

    def _make_tracer(self):
        if not self.cfg.trace_path:
            return None
        try:
            from .traces import TraceRecorder
        except ImportError:
            logger.warning("sglang_prr: --prr-trace-path given but sglang_prr.traces is missing")
            return None
        return TraceRecorder(self.cfg, self.num_layers, self.num_kv_heads)

    def _summary_tensors(self) -> List[torch.Tensor]:
        return [self.kmin, self.kmax] if self.cfg.method == "quest" else [self.ck]

    def _summary(self, layer_id: int) -> List[torch.Tensor]:
        if self.cfg.method == "quest":
            return [self.kmin[layer_id], self.kmax[layer_id]]
        return [self.ck[layer_id]]

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
            self.state.apply_resets()
            self.stats.extend_batches += 1
            self._ext_plan = None
        elif mode.is_decode():
            self.stats.decode_batches += 1
            lens = getattr(fb, "seq_lens_cpu", None)
            if lens is not None:
                real = len(lens) - int(getattr(fb, "num_padding", 0) or 0)
                self.stats.count_batch(lens, real, self.cfg.min_context, self.sparse_layers)

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

    def _plan_decode(self, fb) -> None:
        """The per-forward values of the decode step, kept on the batch for its layers."""
        if self.active and fb.forward_mode.is_decode():
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
                or not fb.forward_mode.is_decode()):
            return fb
        view = copy.copy(fb)
        view.seq_lens = torch.ones_like(fb.seq_lens)
        view.seq_lens_cpu = torch.ones_like(lens_cpu)
        view.seq_lens_sum = int(view.seq_lens_cpu.sum())
        return view

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
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
        Hk, D = self.num_kv_heads, self.head_dim
        loc = fb.out_cache_loc
        pos = fb.positions
        if self.cfg.method == "quest":
            # Decode writes one token per request, each into its own last page: one launch.
            ops.quest_update(self.kmin[layer_id], self.kmax[layer_id], k.reshape(-1, Hk, D), loc,
                             pos, self.page, one_per_page=fb.forward_mode.is_decode())
        else:
            req_idx = self._token_req_idx(fb)
            ops.infllm_update(self.ck[layer_id], self.kv_pool.get_key_buffer(layer_id),
                              self.req_pool.req_to_token, req_idx, loc, pos, self.page)

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
        if self.cfg.calib_queries >= 2 and not self.cfg.serial:
            self._calib_sample(layer, q, fb)
            # Calibrate every layer of the forward together after its last sparse layer (per
            # layer when this process does not run every layer, e.g. pipeline parallelism).
            if self._join_layer in (None, layer.layer_id):
                self._calib_run()
        return o

    def _extend_plan(self, fb):
        """Per-forward layout of an extend batch (host lists: a sync here is outside decode),
        and per request the sampled queries' offsets, causal lengths and block table, the same
        for every layer: ``[(row, s0, offs, seq, nb_used, table)]``."""
        if self._ext_plan is None:
            rows = fb.req_pool_indices.tolist()  # host-ok: extend, once per forward
            reqs, start = [], 0
            for row, n_new, n_pre in zip(rows, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu):
                s0, start = start, start + int(n_new)
                phi = min(self.cfg.calib_queries, int(n_new))
                if phi < 1:
                    continue
                # Evenly spaced queries of the chunk, always including its last one.
                offs = torch.linspace(0, n_new - 1, phi, device=self.device).round().long().unique()
                seq = n_pre + offs + 1  # causal lengths [Phi]
                # Only the blocks this chunk can see (host lengths: [.., nb_used], not the
                # static context).
                nb_used = -(-(int(n_pre) + int(n_new)) // self.page)
                table = ops.block_table(self.req_pool.req_to_token, torch.full_like(offs, row),
                                        self.page)[:, :nb_used]
                reqs.append((row, s0, offs, seq, nb_used, table, int(n_pre) + int(n_new)))
            self._ext_plan = {"reqs": reqs, "scores": {}}
        return self._ext_plan

    def _calib_sample(self, layer, q, fb) -> None:
        """Block scores of the sampled queries of this layer, kept until ``_calib_run``."""
        l = layer.layer_id
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        plan = self._extend_plan(fb)
        for i, (row, s0, offs, seq, nb_used, table, _) in enumerate(plan["reqs"]):
            scores = ops.select_blocks(self.cfg.method, q3[s0 + offs], self._summary(l), table,
                                       seq, self.page, layer.scaling)  # [Phi, Hk, nb_used]
            plan["scores"].setdefault(i, []).append((l, scores))

    def _calib_run(self) -> None:
        """Eqs 4-5 for every sampled layer of each request at once (rows of ``ops.calibrate``
        are independent, so this is the per-layer calibration batched over layers: one replay of
        the 80 candidates per request and chunk instead of one per layer). The scores accumulate
        over the chunks of a chunked prefill; theta* = argmax per request and layer (first max,
        on the device); then the predictor is replayed over the sampled queries with theta*
        (continuing the state of earlier chunks) and predicts P for the first decode step."""
        cfg, st, plan = self.cfg, self.state, self._ext_plan
        if plan is None:
            return
        for i, (row, _, offs, seq, nb_used, _, total) in enumerate(plan["reqs"]):
            taken = plan["scores"].pop(i, [])
            if not taken:
                continue
            layers = torch.tensor([l for l, _ in taken], device=self.device)  # [Lc]
            scores = torch.stack([sc for _, sc in taken])  # [Lc, Phi, Hk, nb]
            Lc, Phi = scores.shape[:2]
            nblk = ref.num_blocks(seq, self.page)  # [Phi]
            if Phi >= 2:
                H = ops.calibrate(scores, nblk.unsqueeze(0).expand(Lc, Phi).contiguous(),
                                  self.k_blocks, self.n_pred, cfg.sink_blocks, cfg.local_blocks,
                                  self.alphas, self.betas, self.gammas)  # [Lc, C]
                st.h_sum[layers, row] += H * (Phi - 1)
                st.h_cnt[layers, row] += Phi - 1
                best = torch.argmax(st.h_sum[layers, row], dim=-1)  # first max: lower index
                st.theta[layers, row] = self.grid[best]
                self.stats.calibrations += Lc
                if taken[0][0] == 0:  # the chosen theta of layer 0 (host list, no sync)
                    key = ",".join(f"{x:g}" for x in cfg.theta_grid[int(best[0])])  # host-ok: extend
                    self.stats.theta_counts[key] = self.stats.theta_counts.get(key, 0) + 1
            theta = st.theta[layers, row]  # [Lc, 3]
            lv = st.level[layers, row, :, :nb_used]  # copies [Lc, Hk, nb]
            tr = st.trend[layers, row, :, :nb_used]
            ni = st.n_init[layers, row]
            for p in range(Phi):
                ops.holt_update(lv, tr, ni, scores[:, p].contiguous(),
                                nblk[p:p + 1].expand(Lc).contiguous(), theta[:, 0].contiguous(),
                                theta[:, 1].contiguous())
            st.level[layers, row, :, :nb_used] = lv
            st.trend[layers, row, :, :nb_used] = tr
            st.n_init[layers, row] = ni
            nb_next = ref.num_blocks(torch.full((Lc,), total + 1, device=self.device), self.page)
            p_idx, p_cnt = ops.predict_set(st.level[layers, row], st.trend[layers, row],
                                           theta[:, 2].contiguous(), ni, nb_next, self.n_pred,
                                           cfg.sink_blocks, cfg.local_blocks)
            st.p_idx[layers, row] = p_idx
            st.p_cnt[layers, row] = p_cnt

    # ------------------------------------------------------------------ decode
    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        if not self._applies(layer):
            return self.inner.forward_decode(q, k, v, layer, fb, save_kv_cache=save_kv_cache,
                                             **kwargs)
        cfg, l = self.cfg, layer.layer_id
        Hq, D, Dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        B = fb.seq_lens.shape[0]
        # 1. KV write (the inner backend's store), then the summary of the new token.
        if save_kv_cache and k is not None and v is not None:
            self.kv_pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
        if k is not None:
            self._update_summaries(l, k, fb)
        # 2. The sparse step, for every row (short rows attend every block).
        batch = getattr(fb, "_prr_batch", None)
        if batch is None:  # a path that skipped the metadata hooks: plan here (eager only)
            self._plan_decode(fb)
            batch = fb._prr_batch
        q3 = q.reshape(B, Hq, D)  # a view: rows may be strided (the fused qkv), heads packed
        summary = self._summary(l)
        o = self.step.run(q3, self.kv_pool.get_key_buffer(l), self.kv_pool.get_value_buffer(l),
                          summary, batch, None if cfg.serial else self.state.layer(l),
                          self.stats.counters, layer.scaling, q.dtype,
                          join=self._join_layer in (None, l))
        if self.tracer is not None and self.tracer.wants(l):
            scores = ops.select_blocks(cfg.method, q3, summary, batch.table, batch.seq_lens,
                                       self.page, layer.scaling)
            rids = list(getattr(fb, "rids", None) or [str(i) for i in range(B)])
            self.tracer.record(l, rids, scores, batch.nblk)
        return o.reshape(B, Hq * Dv)


def _decode_step(runner, cfg: PRRConfig, device: torch.device) -> DecodeStep:
    """The runner's ``DecodeStep`` (one per model runner: its side stream and events are shared
    by the runner's backends, whose layers run in order)."""
    step = getattr(runner, "_prr_step", None)
    if step is None:
        step = DecodeStep(cfg.method, cfg.top_k_blocks, cfg.predicted_blocks, cfg.sink_blocks,
                          cfg.local_blocks, cfg.block_size, cfg.min_context,
                          exact=cfg.mode == "exact", serial=cfg.serial, device=device,
                          skip_repair=os.environ.get(ENV_SKIP_REPAIR) == "1")
        try:
            runner._prr_step = step
        except AttributeError:
            pass
    return step
