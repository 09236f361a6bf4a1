"""SGLang plugin entry point (group ``sglang.srt.plugins``): ``apply()`` installs PRR.

``apply()`` is idempotent and safe in every process. SGLang 0.5.17 calls ``load_plugins()`` in
the launching process (``sglang.launch_server``, ``sgl.Engine``) and again at the start of every
spawned scheduler process (``run_scheduler_process``), so with the package installed the entry
point reaches them all. Independently of the entry point, ``apply()`` makes SGLang spawn its
schedulers through ``run_scheduler_process`` below, which calls ``apply()`` in the child first:
the patches reach the children even when the package is only on ``PYTHONPATH``.

What it patches (each once, each logged):

* the attention backend registry: every registered backend is wrapped by ``PRRBackend`` (on CPU
  that is ``torch_native``, the one name SGLang does not treat as Triton);
* ``PagedTokenToKVPoolAllocator.alloc_extend/alloc_decode``: a torch fallback on CPU, where the
  Triton kernels cannot run, so one PRR block is one KV page on every device;
* ``ReqToTokenPool.alloc/clear``: tell the PRR state which request slots were handed out anew;
* the KV cell size: the per-page block summaries are accounted for before SGLang sizes its KV
  cache;
* ``XGrammarGrammar``'s token bitmask on CPU (xgrammar's CPU ops), so that constrained decoding
  (regex, JSON) does not stop a CPU server;
* the HTTP app (launching process only): ``GET /prr/stats``, and a short HTTP 400 for bodies that
  fail validation (``http_guard.py``) where SGLang answered 500 or echoed the whole body;
* ``Engine.__init__`` and ``Engine._launch_subprocesses`` (launching process only): the page size
  follows the block size when left out, and the resolved ``ServerArgs`` are checked against
  PRR (``check_server_args``) before any process starts, as the launcher checks them;
* request validation (``requests.install``, ``serving/requests.py``): token ids outside the
  model's vocabulary ``[0, vocab_size)``, and sampling, logprob and per-request arguments that
  SGLang would pass on to its scheduler and fail there, are rejected with a ``ValueError``,
  which SGLang turns into HTTP 400, instead of taking the server down.

PRR is active when the environment holds a configuration (``SGLANG_PRR_CONFIG``, written by
``python -m sglang_prr.launch_server`` or by ``enable()``); without one, ``apply()`` does nothing
beyond registering the hooks, and SGLang runs unchanged.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from typing import Any, Optional

import torch

from ..config import PRRConfig, PRRConfigError
from . import http_guard, stats
from . import requests as request_checks
from .server_args_patch import ENV_CONFIG, export_config, load_config

logger = logging.getLogger("sglang_prr")

# Request slots assumed when --max-running-requests is not given, for the state reservation.
STATE_ROWS_ESTIMATE = 256

_applied = False
_patched = set()


def enable(cfg: Optional[PRRConfig] = None, **options: Any) -> PRRConfig:
    """Turn PRR on for engines created afterwards in this process (``sgl.Engine(...)``).

    ``enable(top_k=512, block_size=16)`` or ``enable(PRRConfig(...))``. The engine's page size
    follows the block size when left out; another one is a ``PRRArgsError`` from
    ``sgl.Engine(...)``. Returns the validated configuration.
    """
    if cfg is not None and options:
        raise PRRConfigError(f"enable() takes a PRRConfig or options, not both: "
                             f"{', '.join(sorted(options))} given beside the PRRConfig")
    cfg = cfg.validate() if cfg is not None else PRRConfig.from_options(**options)
    export_config(cfg)
    global _applied
    _applied = False  # re-run so that the configuration is picked up
    apply()
    return cfg


# What ``GET /prr/stats`` answers, for the engines this process started (``sgl.Engine``).
read_stats = stats.read_stats


def current_config() -> Optional[PRRConfig]:
    return load_config()


def _is_main_process() -> bool:
    return multiprocessing.parent_process() is None


def apply() -> None:
    """Install PRR's hooks into SGLang (idempotent)."""
    global _applied
    if _applied:
        return
    _applied = True
    cfg = load_config()
    if cfg is None:
        logger.debug("sglang_prr: no PRR configuration in %s; SGLang runs unchanged", ENV_CONFIG)
        return
    if _is_main_process():
        stats.stats_path()  # fix the path before children are spawned, so they inherit it
    _patch_scheduler_entry()
    _patch_allocator()  # paged KV on CPU, also for the dense baseline (--prr-method dense)
    _patch_cpu_grammar()  # constrained decoding on CPU, also for the dense baseline
    if _is_main_process():
        _patch_http_app()
        _patch_engine()
    _patch_request_validation()  # wherever a TokenizerManager may run; class-level, cheap
    if not cfg.enabled:
        logger.info("sglang_prr: --prr-method dense: dense attention, PRR off")
        return
    _patch_attention_registry()
    _patch_req_pool()
    _patch_cell_size(cfg)
    logger.info("sglang_prr: PRR installed (pid %d): %s", os.getpid(), json.dumps(cfg.to_dict()))


def run_scheduler_process(*args, **kwargs):
    """SGLang's scheduler process entry, preceded by ``apply()`` in the child process."""
    apply()
    from sglang.srt.managers.scheduler import run_scheduler_process as _orig

    return _orig(*args, **kwargs)


# ----------------------------------------------------------------------------- patches
def _once(name: str) -> bool:
    if name in _patched:
        return False
    _patched.add(name)
    return True


def _patch_scheduler_entry() -> None:
    if not _once("scheduler_entry"):
        return
    from sglang.srt.entrypoints.engine import Engine

    Engine.run_scheduler_process_func = staticmethod(run_scheduler_process)
    logger.info("sglang_prr: scheduler processes start through sglang_prr.serving.plugin")


def _patch_attention_registry() -> None:
    if not _once("attention_registry"):
        return
    from sglang.srt.layers.attention import attention_registry as reg

    def wrap(name, factory):
        def create(runner):
            from .backend import wrap_backend

            return wrap_backend(factory(runner), runner, name)

        create._prr_wrapped = True
        return create

    for name, factory in list(reg.ATTENTION_BACKENDS.items()):
        if not getattr(factory, "_prr_wrapped", False):
            reg.ATTENTION_BACKENDS[name] = wrap(name, factory)
    logger.info("sglang_prr: attention backends wrapped by PRRBackend")


def _cpu_alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                      extend_num_tokens, num_new_pages=None):
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive
    from sglang.srt.utils import get_num_new_pages

    bs = len(prefix_lens)
    if self.need_sort and extend_num_tokens // self.page_size + bs + 1 > len(self.free_pages):
        self.merge_and_sort_free()
    if num_new_pages is None:
        num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size,
                                          prefix_lens=prefix_lens_cpu)
    if num_new_pages > len(self.free_pages):
        return None
    out_indices = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
    alloc_extend_naive(prefix_lens, seq_lens, last_loc, self.free_pages, out_indices,
                       self.page_size, self.device)
    self.free_pages = self.free_pages[num_new_pages:]
    return out_indices


def _cpu_alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
    from sglang.srt.utils import get_num_new_pages

    bs = len(seq_lens)
    if self.need_sort and bs > len(self.free_pages):
        self.merge_and_sort_free()
    num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size,
                                      decode=True)
    if num_new_pages > len(self.free_pages):
        return None
    p = self.page_size
    s = seq_lens.long()
    new = ((s + p - 1) // p - (s - 1 + p - 1) // p) > 0  # [bs] needs a fresh page
    start = torch.cumsum(new.long(), 0) - new.long()
    pages = self.free_pages[start.clamp(max=max(len(self.free_pages) - 1, 0))] \
        if len(self.free_pages) else torch.zeros_like(s)
    out = torch.where(new, pages * p, last_loc.long() + 1)
    self.free_pages = self.free_pages[num_new_pages:]
    return out


def _patch_allocator() -> None:
    if not _once("allocator"):
        return
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator as A

    orig_ext, orig_dec = A.alloc_extend, A.alloc_decode

    def alloc_extend(self, *args, **kwargs):
        if str(self.device).startswith("cpu"):
            return _cpu_alloc_extend(self, *args, **kwargs)
        return orig_ext(self, *args, **kwargs)

    def alloc_decode(self, *args, **kwargs):
        if str(self.device).startswith("cpu"):
            return _cpu_alloc_decode(self, *args, **kwargs)
        return orig_dec(self, *args, **kwargs)

    A.alloc_extend, A.alloc_decode = alloc_extend, alloc_decode
    logger.info("sglang_prr: paged KV allocator has a torch fallback on CPU")


def _patch_req_pool() -> None:
    if not _once("req_pool"):
        return
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from .. import state

    orig_alloc, orig_clear = ReqToTokenPool.alloc, ReqToTokenPool.clear

    def alloc(self, reqs):
        fresh = [r for r in reqs if r.req_pool_idx is None]
        out = orig_alloc(self, reqs)
        if out is not None and fresh:
            state.notify_new_slots(self, [r.req_pool_idx for r in fresh])
        return out

    def clear(self):
        orig_clear(self)
        state.notify_clear(self)

    ReqToTokenPool.alloc, ReqToTokenPool.clear = alloc, clear
    logger.info("sglang_prr: request slots reset the PRR state when handed out")


def _patch_cell_size(cfg: PRRConfig) -> None:
    if not _once("cell_size"):
        return
    from sglang.srt.model_executor import pool_configurator as pc

    orig = pc.DefaultPoolConfigurator._compute_cell_size

    def _compute_cell_size(self, kvc, num_layers):
        cell = orig(self, kvc, num_layers)
        try:
            from sglang.srt.runtime_context import get_parallel

            from ..state import summary_bytes_per_token

            mc = kvc.model_config
            hk = mc.get_num_kv_heads(get_parallel().attn_tp_size)
            extra = summary_bytes_per_token(cfg, num_layers, hk, mc.head_dim)
            # The predictor state is per request slot; SGLang picks the slot count after the
            # KV size, so reserve it for the configured (or default-capped) request count.
            from ..state import state_bytes

            rows = int(kvc.server_args.max_running_requests or STATE_ROWS_ESTIMATE) + 1
            self._prr_state_bytes = state_bytes(cfg, num_layers, hk, rows,
                                                int(mc.context_len))
        except Exception as e:  # never block startup on the estimate
            logger.warning("sglang_prr: could not size block summaries (%s)", e)
            extra = 0
        return cell + extra

    orig_sizes = pc.DefaultPoolConfigurator.calculate_pool_sizes

    def calculate_pool_sizes(self, available_bytes, page_size):
        reserve = int(getattr(self, "_prr_state_bytes", 0))
        if reserve:
            logger.info("sglang_prr: reserving %.1f MiB for the predictor state",
                        reserve / 2**20)
        return orig_sizes(self, max(int(available_bytes) - reserve, 0), page_size)

    pc.DefaultPoolConfigurator._compute_cell_size = _compute_cell_size
    pc.DefaultPoolConfigurator.calculate_pool_sizes = calculate_pool_sizes


def _patch_engine() -> None:
    """``sgl.Engine`` (and SGLang's own launchers) meet the launcher's rules in the launching
    process: a page size left out follows the PRR block size, and ``check_server_args`` runs on
    the resolved ``ServerArgs`` before any process is spawned, so a page size other than the
    block size, or a layer id the model lacks, is a ``PRRArgsError`` from ``sgl.Engine(...)``
    (it was dense attention without a word, or a scheduler that died with a traceback). Both
    read the configuration at the call, so a later ``enable()`` counts; the statistics an
    earlier engine of this process wrote are cleared (``read_stats`` is the new one's)."""
    if not _once("engine"):
        return
    from sglang.srt.entrypoints.engine import Engine

    from .server_args_patch import check_server_args

    init = Engine.__init__
    launch = Engine.__dict__["_launch_subprocesses"].__func__

    def __init__(self, **kwargs):
        cfg = load_config()
        if cfg is not None and cfg.enabled and "server_args" not in kwargs \
                and kwargs.get("page_size") is None:
            kwargs["page_size"] = cfg.block_size
        init(self, **kwargs)

    def _launch_subprocesses(cls, server_args, *args, **kwargs):
        cfg = load_config()
        if cfg is not None:
            # The launcher has run these on the same arguments already: they are idempotent
            # and cost a model-config read, so every other entry point is not left unchecked.
            check_server_args(cfg, server_args, torch.cuda.is_available())
            export_config(cfg)  # K and |P| capped at the context: the schedulers read this
        stats.clear_stats()  # an earlier engine's counts are not this one's
        return launch(cls, server_args, *args, **kwargs)

    __init__.__doc__ = init.__doc__
    Engine.__init__ = __init__
    Engine._launch_subprocesses = classmethod(_launch_subprocesses)
    logger.info("sglang_prr: sgl.Engine derives its page size from the PRR block size and "
                "checks its arguments against PRR before it starts")


def _patch_http_app() -> None:
    if not _once("http_app"):
        return
    try:
        from sglang.srt.entrypoints import http_server
    except Exception as e:  # engine-only installs may lack the HTTP stack
        logger.info("sglang_prr: no HTTP app to extend (%s)", e)
        return
    from fastapi.responses import JSONResponse

    async def prr_stats():
        return JSONResponse(stats.read_stats())

    http_server.app.add_api_route("/prr/stats", prr_stats, methods=["GET"])
    logger.info("sglang_prr: GET /prr/stats added")
    guarded = http_guard.install(http_server.app)
    logger.info("sglang_prr: bodies that fail validation get a short 400 (%d routes)", guarded)


def _patch_cpu_grammar() -> None:
    """Constrained decoding (regex, JSON schema, EBNF) on CPU: SGLang's xgrammar backend pins
    its token bitmask (``pin_memory=True`` needs CUDA) and applies it with a GPU kernel, so the
    first constrained request stopped a CPU server. xgrammar's own CPU bitmask and apply replace
    them where CUDA is absent."""
    if torch.cuda.is_available() or not _once("cpu_grammar"):
        return
    try:
        import xgrammar
        from sglang.srt.constrained import xgrammar_backend as xb
    except Exception as e:  # pragma: no cover - no grammar backend installed
        logger.info("sglang_prr: no xgrammar backend to adapt to CPU (%s)", e)
        return
    orig_apply = xb.XGrammarGrammar.apply_vocab_mask

    def allocate_vocab_mask(self, vocab_size, batch_size, device):
        return xgrammar.allocate_token_bitmask(batch_size, vocab_size)

    def apply_vocab_mask(self, logits, vocab_mask):
        if logits.device.type != "cpu":
            return orig_apply(self, logits, vocab_mask)
        xgrammar.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device))

    xb.XGrammarGrammar.allocate_vocab_mask = allocate_vocab_mask
    xb.XGrammarGrammar.apply_vocab_mask = apply_vocab_mask
    logger.info("sglang_prr: constrained decoding's token bitmask on CPU (xgrammar)")


def _patch_request_validation() -> None:
    if _once("request_validation"):
        request_checks.install()
        logger.info("sglang_prr: requests with token ids outside the vocabulary, or arguments "
                    "that would stop the scheduler, are rejected (400)")
