"""fp64 oracle for the PRR semantics, written independently of ``sglang_prr.reference``.

Plain Python loops over requests, heads and blocks, addressing tokens through ``req_to_token``
positions (not pages), in float64. Slow and obvious on purpose: it referees the reference.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Set, Tuple

import torch

WINDOW, STRIDE = 32, 16


def token_slots(req_to_token, slot_row: int, lo: int, hi: int) -> List[int]:
    return [int(req_to_token[slot_row, p]) for p in range(lo, hi)]


def block_tokens(req_to_token, slot_row: int, blk: int, seq_len: int, page: int) -> List[int]:
    return token_slots(req_to_token, slot_row, blk * page, min((blk + 1) * page, seq_len))


def quest_scores(q, k_buf, req_to_token, rows, seq_lens, page) -> List[List[List[float]]]:
    """scores[b][h_kv][blk] from exact per-block key min/max (float64)."""
    B, Hq, D = q.shape
    Hk = k_buf.shape[1]
    G = Hq // Hk
    out = []
    for b in range(B):
        L = int(seq_lens[b])
        nb = -(-L // page)
        per_head = []
        for h in range(Hk):
            s = []
            for j in range(nb):
                ks = k_buf[block_tokens(req_to_token, int(rows[b]), j, L, page), h].double()
                lo, hi = ks.min(0).values, ks.max(0).values
                tot = 0.0
                for g in range(G):
                    qd = q[b, h * G + g].double()
                    # fmax: a NaN product (0 * inf) yields to the other bound's
                    tot += float(torch.fmax(qd * hi, qd * lo).sum())
                s.append(tot)
            per_head.append(s)
        out.append(per_head)
    return out


def infllm_scores(q, k_buf, req_to_token, rows, seq_lens, page, sm_scale) -> List[List[List[float]]]:
    B, Hq, D = q.shape
    Hk = k_buf.shape[1]
    G = Hq // Hk
    out = []
    for b in range(B):
        L = int(seq_lens[b])
        nb = -(-L // page)
        n_ck = max(0, (L - WINDOW) // STRIDE + 1)
        per_head = []
        for h in range(Hk):
            cks = []
            for i in range(n_ck):
                slots = token_slots(req_to_token, int(rows[b]), STRIDE * i, STRIDE * i + WINDOW)
                cks.append(k_buf[slots, h].double().mean(0))
            probs = [0.0] * n_ck
            for g in range(G):
                if n_ck == 0:
                    break
                logits = torch.stack([q[b, h * G + g].double() @ c for c in cks]) * sm_scale
                p = torch.softmax(logits, 0)
                if torch.isnan(p).any():
                    continue  # an undefined softmax (a NaN or +inf logit) adds nothing
                for i in range(n_ck):
                    probs[i] += float(p[i])
            s = [-math.inf] * nb
            for i in range(n_ck):
                for blk in {(STRIDE * i) // page, (STRIDE * i + WINDOW - 1) // page}:
                    s[blk] = max(s[blk], probs[i])
            per_head.append(s)
        out.append(per_head)
    return out


def topk_set(scores: Sequence[float], nb: int, k: int, sink: int, local: int) -> Set[int]:
    keep = {j for j in range(nb) if j < sink or j >= nb - local}
    middle = [j for j in range(nb) if j not in keep]
    # Higher score first; ties to the lower block id; NaN/-inf rank last.
    def key(j):
        v = scores[j]
        v = -math.inf if (v != v) else v
        return (-v, j)
    return keep | set(sorted(middle, key=key)[:k])


def attention(q, k_buf, v_buf, req_to_token, rows, seq_lens, page, sm_scale,
              sets: Sequence[Sequence[Set[int]]]) -> torch.Tensor:
    """o[b, hq] over the blocks sets[b][h_kv] (float64); an empty set gives zeros."""
    B, Hq, D = q.shape
    Hk = k_buf.shape[1]
    G = Hq // Hk
    o = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(seq_lens[b])
        for h in range(Hk):
            slots = []
            for j in sorted(sets[b][h]):
                slots += block_tokens(req_to_token, int(rows[b]), j, L, page)
            if not slots:
                continue
            k = k_buf[slots, h].double()
            v = v_buf[slots, h].double()
            for g in range(G):
                w = torch.softmax(k @ q[b, h * G + g].double() * sm_scale, 0)
                o[b, h * G + g] = w @ v
    return o


def holt_loop(series: Sequence[Sequence[float]], alpha: float, beta: float, gamma: float,
              restart_nonfinite: bool = True) -> List[Dict[int, float]]:
    """Eqs 2-3 for one (request, head): series[t][j] = IS of block j at step t (blocks only grow).

    A block whose level or trend is not finite starts again like a new one
    (``restart_nonfinite``; False is the rule without that fix, kept for negative controls). Returns, for each step t >= 1, the
    prediction IS_hat[t][j] made before step t's update, for the blocks that had state."""
    level: Dict[int, float] = {}
    trend: Dict[int, float] = {}
    preds = []
    for t, row in enumerate(series):
        if t > 0:
            preds.append({j: level[j] + gamma * trend[j] for j in level})
        for j, s in enumerate(row):
            if j not in level or (restart_nonfinite and not (math.isfinite(level[j])
                                                             and math.isfinite(trend[j]))):
                level[j], trend[j] = s, 0.0
            else:
                v = beta * (s - level[j]) + (1 - beta) * trend[j]
                level[j] = alpha * s + (1 - alpha) * level[j]
                trend[j] = v
    return preds


def weighted_hit(row: Sequence[float], a: Set[int], p: Set[int], middle: Set[int]) -> float:
    am = a & middle
    if not am:
        return 1.0
    lo = min(row[j] for j in middle)
    den = sum(row[j] - lo for j in am)
    if den <= 0:
        return len(am & p) / len(am)
    return sum(row[j] - lo for j in am & p) / den


def calibrate_one(series: Sequence[Sequence[float]], k: int, n_pred: int, sink: int, local: int,
                  theta: Tuple[float, float, float]) -> float:
    """Eq 4 for one (request, head) and one theta, by a scalar loop."""
    preds = holt_loop(series, *theta)
    total = 0.0
    for t in range(1, len(series)):
        row = series[t]
        nb = len(row)
        pred = [preds[t - 1].get(j, -math.inf) for j in range(nb)]
        a = topk_set(row, nb, k, sink, local)
        p = topk_set(pred, nb, n_pred, sink, local)
        middle = {j for j in range(nb) if not (j < sink or j >= nb - local)}
        total += weighted_hit(row, a, p, middle)
    return total / max(len(series) - 1, 1)
