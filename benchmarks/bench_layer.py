"""One question: per-layer decode latency of PRR vs serial DSA vs dense FlashInfer, side by side.

Llama-3-8B layer shape by default (32 q / 8 KV heads, dim 128, bf16 KV), SGLang's paged KV layout
(one page = one PRR block), Quest selection. Each variant is captured in a CUDA graph and timed
over replays (median and p10-p90 spread); queries drift between replays from a precomputed pool
(the same pool and index bump in every variant), so the predictor sees realistic changes and
the hit rate |P n A| / |A| measured during the replays is reported beside the times.

  python benchmarks/bench_layer.py                       # 32K/128K x batch 1/8 on CUDA
  python benchmarks/bench_layer.py --quick --device cpu  # smoke run of the same code on CPU

Variants: dense = FlashInfer paged decode over every page (skipped when FlashInfer is missing);
serial = ``step.DecodeStep(serial=True)``: selection then attention over A on one stream; prr =
``step.DecodeStep(serial=False)``, what the server runs: speculative attention over P beside the
selection, then repair over M with the exact merge, and the predictor step writing P(t+1) in place
(one layer per forward, so the side stream joins after it). As in the server, the predictor state
lives in pool-shaped tensors ``[R, Hk, ...]`` (row 0: SGLang's padding row) read and written at
the batch's request slots, and the per-forward values come from ``DecodeStep.plan``, made once
outside the timed graph (every layer of a forward shares them). Stage rows time the selection
(scores, A, M), the predictor step, the speculative pass, the repair, the merge and the repair
with its merge (one op) alone. ``SGLANG_PRR_FUSED_MERGE=1`` makes that op one launch.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sglang_prr import ops  # noqa: E402
from sglang_prr.step import DecodeStep, LayerState, new_layer_state  # noqa: E402
from sglang_prr.synthetic import paged_kv  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the benchmarks' one graph timer)


def build(batch, ctx, page, hq, hk, d, dtype, dev, n_queries, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    # A handful of blocks per request carry a "topic" direction that the queries follow.
    topic = torch.randn(batch, hk, d, generator=g)
    kv = paged_kv(batch, ctx, page, hk, d, dtype=dtype, device=dev, generator=g, topic=topic,
                  hot_blocks=24)
    group = hq // hk
    drift = torch.cumsum(torch.randn(n_queries, batch, hk, d, generator=g) * 0.15, 0)
    qs = ((topic + drift).repeat_interleave(group, 2) * 3.0
          + torch.randn(n_queries, batch, hq, d, generator=g)).to(dev, dtype)
    seq = torch.full((batch,), ctx, device=dev, dtype=torch.long)
    return dict(k_buf=kv.k_buf, v_buf=kv.v_buf, qs=qs, table=kv.table, kmin=kv.kmin,
                kmax=kv.kmax, seq=seq, pages=kv.pages, n_pages=kv.n_pages,
                req_to_token=kv.req_to_token, rows=kv.rows)


def pool_state(R, hk, nb, width, dev):
    """Fresh predictor state of one layer over ``R`` request slots (as ``state.PRRState`` holds
    it): P ``[2R, Hk, width]`` (double-buffered) empty, no history, theta = (0.6, 0.3, 0.5)."""
    return new_layer_state(R, hk, nb, width, (0.6, 0.3, 0.5), dev)


def flashinfer_dense(env, batch, ctx, page, hq, hk, d, dev):
    if dev.type != "cuda":
        return None
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - report and skip the baseline
        print(f"[dense] FlashInfer unavailable: {e}")
        return None
    npg = -(-ctx // page)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * npg
    indices = env["pages"][:, :npg].reshape(-1).int().to(dev)
    last = torch.full((batch,), ctx - (npg - 1) * page, dtype=torch.int32, device=dev)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
    w.plan(indptr, indices, last, hq, hk, d, page, q_data_type=env["qs"].dtype,
           kv_data_type=env["k_buf"].dtype)
    kc = env["k_buf"].view(env["n_pages"], page, hk, d)
    vc = env["v_buf"].view(env["n_pages"], page, hk, d)
    return lambda q: w.run(q, (kc, vc))


def time_graph(fn, q_buf, qs, dev, iters, warmup=5):
    """Capture ``fn`` (which reads q_buf) with the pool bump in a graph; median/p10/p90 in us."""
    n = qs.shape[0]
    step = torch.zeros((), dtype=torch.long, device=dev)

    def body():
        q_buf.copy_(qs.index_select(0, step.view(1)).squeeze(0))
        step.add_(1).remainder_(n)
        fn(q_buf)

    if dev.type != "cuda":
        ts = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            body()
            if i >= warmup:
                ts.append((time.perf_counter() - t0) * 1e6)
        return common.summary(ts)
    return common.time_graph([body], iters, warmup=warmup)


def plot(csv_paths, png):
    """Grouped bars of the variants' median latency per (ctx, batch), one panel per CSV."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(csv_paths), figsize=(7 * len(csv_paths), 4), squeeze=False)
    for ax, path in zip(axes[0], csv_paths):
        with open(path) as f:
            rows = [r for r in csv.DictReader(f) if not r["variant"].startswith("stage")]
        cases = sorted({(int(r["ctx"]), int(r["batch"])) for r in rows})
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            ys = [next((float(r["median_us"]) for r in rows if r["variant"] == v
                        and (int(r["ctx"]), int(r["batch"])) == c), 0.0) for c in cases]
            ax.bar([j + i * width for j in range(len(cases))], ys, width, label=v)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"{c // 1024}K, bs {b}" for c, b in cases])
        ax.set_yscale("log")
        ax.set_ylabel("per-layer decode latency, us (median)")
        ax.set_title(os.path.basename(path))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2048, help="tokens")
    ap.add_argument("--budget", type=float, default=1.5)
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HK", "D"))
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "layer.csv"))
    ap.add_argument("--plot-only", nargs="+", metavar="CSV",
                    help="draw the PNG of earlier CSV runs (beside the first CSV) and exit")
    a = ap.parse_args(argv)
    if a.plot_only:
        plot(a.plot_only, os.path.splitext(a.plot_only[0])[0] + ".png")
        return []
    dev = torch.device(a.device)
    if a.quick:
        a.contexts, a.batches, a.iters, a.heads, a.page, a.top_k = [1024], [2], 3, [8, 2, 32], 16, 128
    hq, hk, d = a.heads
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cuda":
        try:
            from sglang_prr import kernels
            kernels.load()
        except Exception as e:  # noqa: BLE001 - the reference ops still run
            print(f"[kernels] not loaded, timing the torch reference ops: {e}")
    k = -(-a.top_k // a.page)
    n_pred = max(k, int(a.budget * k))
    scale = 1.0 / math.sqrt(d)
    rows = []
    for ctx in a.contexts:
        for batch in a.batches:
            env = build(batch, ctx, a.page, hq, hk, d, dtype, dev, n_queries=64)
            q_buf = env["qs"][0].clone()
            summ = [env["kmin"], env["kmax"]]
            kv = (env["k_buf"], env["v_buf"], summ)
            res = {}
            dense = flashinfer_dense(env, batch, ctx, a.page, hq, hk, d, dev)
            if dense is not None:
                res["dense (FlashInfer)"] = time_graph(dense, q_buf, env["qs"], dev, a.iters)
            # Quest, one sink and one local block, no dense rows (min_context 0), as before.
            serial, step = (DecodeStep("quest", k, n_pred, 1, 1, a.page, 0, exact=True,
                                       serial=s, device=dev) for s in (True, False))
            # The per-forward values (block table, block counts), shared by every layer.
            b_ser = serial.plan(env["req_to_token"], env["rows"], env["seq"])
            b = step.plan(env["req_to_token"], env["rows"], env["seq"])
            table, seq, slots = b.table, b.seq_lens, b.rows  # slots: the state rows
            nb = table.shape[1]
            res["serial DSA"] = time_graph(
                lambda q: serial.run(q, *kv, b_ser, None, None, scale, dtype),
                q_buf, env["qs"], dev, a.iters)
            st = pool_state(batch + 1, hk, nb, n_pred + 2, dev)  # row 0: the padding row
            stats = torch.zeros(4, dtype=torch.int64, device=dev)  # sum |A|, |M|, |P|, rows

            def prr(q, count_hits=False):
                # Planned in the step (recorded into the graph, as the server records it): each
                # replay flips P's double buffer, so the prediction evolves from step to step.
                bb = step.plan(env["req_to_token"], env["rows"], env["seq"])
                return step.run(q, *kv, bb, st, stats if count_hits else None, scale, dtype)

            res["PRR (exact)"] = time_graph(prr, q_buf, env["qs"], dev, a.iters)
            # The hit rate, from untimed steps that continue the same query stream (its
            # bookkeeping is not part of PRR's timing and stays out of the timed graph).
            for i in range(min(a.iters, env["qs"].shape[0])):
                q_buf.copy_(env["qs"][i])
                prr(q_buf, count_hits=True)
            a_sum, m_sum = stats[:2].tolist()  # host-ok: benchmark readout
            hit = 1.0 - m_sum / max(a_sum, 1.0)
            # Stages alone, for the timeline (the step's ops, on the same pool-row state).
            # P(t) lives in rows b.p_cur of the double-buffered pool P.
            sel = dict(nblk=b.nblk, n_out=step.n_out, dense_row=b.dense_row, p_rows=b.p_cur)
            res["stage: selection"] = time_graph(
                lambda q: ops.select_fused("quest", q, summ, table, seq, a.page, scale, k, 1, 1,
                                           st.p_idx, st.p_cnt, **sel)[1],
                q_buf, env["qs"], dev, a.iters)
            scratch = LayerState(*(t.clone() for t in st))  # the predictor writes it in place
            res["stage: selection + predictor"] = time_graph(
                lambda q: ops.quest_select_predict(
                    q, summ[0], summ[1], table, b.nblk, b.nblk_next, scratch.p_idx,
                    scratch.p_cnt, b.p_cur, b.p_nxt, scratch.level, scratch.trend,
                    scratch.n_init, scratch.theta, slots, k, n_pred, 1, 1, step.n_out,
                    b.dense_row)[1],
                q_buf, env["qs"], dev, a.iters)
            res["stage: spec attention"] = time_graph(
                lambda q: ops.sparse_attn_partials(q, env["k_buf"], env["v_buf"], table, seq,
                                                   st.p_idx, st.p_cnt, a.page, scale,
                                                   idx_rows=b.p_cur),
                q_buf, env["qs"], dev, a.iters)
            # Repair over this step's M and the exact merge, alone (PRR's critical path after
            # the join).
            _, a_idx, a_cnt, m_idx, m_cnt = ops.select_fused(
                "quest", q_buf, summ, table, seq, a.page, scale, k, 1, 1, st.p_idx, st.p_cnt,
                **sel)
            res["stage: repair over M"] = time_graph(
                lambda q: ops.sparse_attn_partials(q, env["k_buf"], env["v_buf"], table, seq,
                                                   m_idx, m_cnt, a.page, scale),
                q_buf, env["qs"], dev, a.iters)
            o_s, l_s = ops.sparse_attn_partials(q_buf, env["k_buf"], env["v_buf"], table, seq,
                                                st.p_idx, st.p_cnt, a.page, scale, idx_rows=b.p_cur)
            o_r, l_r = ops.sparse_attn_partials(q_buf, env["k_buf"], env["v_buf"], table, seq,
                                                m_idx, m_cnt, a.page, scale)
            p_idx, p_cnt = st.p_idx[b.p_cur], st.p_cnt[b.p_cur]  # prr_merge: batch-ordered P
            res["stage: merge"] = time_graph(
                lambda q: ops.prr_merge(o_s, l_s, p_idx, p_cnt, a_idx, a_cnt, o_r, l_r, nb, True),
                q_buf, env["qs"], dev, a.iters)
            res["stage: repair + merge"] = time_graph(
                lambda q: ops.sparse_attn_merge(q, env["k_buf"], env["v_buf"], table, seq, m_idx,
                                                m_cnt, a.page, scale, o_s, l_s, st.p_idx,
                                                st.p_cnt, a_idx, a_cnt, nb, True, p_rows=b.p_cur,
                                                out_dtype=dtype),
                q_buf, env["qs"], dev, a.iters)
            for name, (med, p10, p90) in res.items():
                rows.append(dict(device=str(dev), ctx=ctx, batch=batch, page=a.page,
                                 top_k_tokens=a.top_k, budget=a.budget, variant=name,
                                 median_us=round(med, 2), p10_us=round(p10, 2),
                                 p90_us=round(p90, 2), hit_rate=round(hit, 4)))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"\n{name}, {time.strftime('%Y-%m-%d')}, page {a.page}, K={a.top_k} tokens, "
          f"delta={a.budget}, heads {hq}/{hk}x{d}")
    print(f"{'ctx':>7} {'batch':>5} {'variant':<22} {'median us':>10} {'p10-p90':>15} {'hit':>6}")
    for r in rows:
        print(f"{r['ctx']:>7} {r['batch']:>5} {r['variant']:<22} {r['median_us']:>10} "
              f"{r['p10_us']:>7}-{r['p90_us']:<7} {r['hit_rate']:>6}")
    return rows


if __name__ == "__main__":
    main()
