"""Request helpers shared by the integration tests: greedy generation with logprobs."""

from __future__ import annotations

import random
import time
from typing import Dict, List, Optional

import requests

TIMEOUT_S = 600
TOP_N = 5  # top logprobs compared per step


def prompt_ids(seed: int, length: int, vocab: int = 500) -> List[int]:
    """Random token ids (ids 6.. avoid the special tokens); printed seed in the caller."""
    rng = random.Random(seed)
    return [rng.randrange(6, vocab) for _ in range(length)]


def generate(server, input_ids: List[int], max_new_tokens: int = 8, extra: Optional[Dict] = None
             ) -> Dict:
    body = {"input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": TOP_N}
    if extra:
        body.update(extra)
    r = requests.post(server.url + "/generate", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def logprob_table(out: Dict) -> Dict[str, list]:
    """Output ids, their logprobs, and the top-N (id, logprob) of every step."""
    mi = out["meta_info"]
    ids = [t[1] for t in mi["output_token_logprobs"]]
    lps = [t[0] for t in mi["output_token_logprobs"]]
    tops = [[(t[1], t[0]) for t in step] for step in mi["output_top_logprobs"]]
    return {"ids": ids, "lps": lps, "tops": tops}


def max_logprob_diff(a: Dict, b: Dict, tie: float = 1e-4) -> float:
    """Largest difference over the chosen-token logprobs and the top-N logprobs, comparing
    values by token id; ``inf`` if the greedy tokens or the top-N id sets differ.

    One exception, a near-tie: where the two runs first choose different tokens and each run
    gives both tokens logprobs within ``tie`` of each other, the argmax flipped on rounding
    (batched GEMMs sum in another order), not on a different attention. That step's common
    logprobs still count; later steps are not compared, their contexts differ."""
    ta, tb = logprob_table(a), logprob_table(b)
    if len(ta["ids"]) != len(tb["ids"]):
        return float("inf")
    d = 0.0
    for i, (sa, sb) in enumerate(zip(ta["tops"], tb["tops"])):
        da, db = dict(sa), dict(sb)
        common = set(da) & set(db)
        if len(common) < TOP_N - 1:  # the last rank may swap on near-ties
            return float("inf")
        d = max([d] + [abs(da[t] - db[t]) for t in common])
        ia, ib = ta["ids"][i], tb["ids"][i]
        if ia == ib:
            d = max(d, abs(ta["lps"][i] - tb["lps"][i]))
            continue
        tied = all(t in da and t in db for t in (ia, ib)) and \
            abs(da[ia] - da[ib]) <= tie and abs(db[ia] - db[ib]) <= tie
        return d if tied else float("inf")
    return d


def first_step_diff(a: Dict, b: Dict) -> float:
    """Difference of the top-N logprobs at steps where both runs saw the same tokens so far."""
    ta, tb = logprob_table(a), logprob_table(b)
    d = 0.0
    for i, (sa, sb) in enumerate(zip(ta["tops"], tb["tops"])):
        da, db = dict(sa), dict(sb)
        for tid in set(da) & set(db):
            d = max(d, abs(da[tid] - db[tid]))
        if set(da) != set(db):
            d = max(d, 1.0)
        if ta["ids"][i] != tb["ids"][i]:
            break
    return d


def flush_cache(server, timeout_s: float = 60.0) -> None:
    """Flush the server's radix cache (and PRR's state with it). SGLang refuses (400) while a
    request is still finishing, e.g. an aborted stream of an earlier test: retry until it
    accepts."""
    t_end = time.time() + timeout_s
    while True:
        r = requests.post(server.url + "/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        if time.time() > t_end:
            raise AssertionError(f"flush_cache kept failing: {r.status_code} {r.text}")
        time.sleep(1.0)
