"""Record real attention traces: SmolLM2-135M-Instruct on CPU, long prompts of installed source code.

Starts ``python -m sglang_prr.launch_server`` (the real default model, CPU flags added by the
launcher) on a free port with ``--prr-trace-path``, sends a few long prompts as ``input_ids`` to
``/generate`` (greedy, ``ignore_eos``), stops the server's whole process group and leaves one
``.npz`` trace per request in ``--out`` (format: ``sglang_prr.tools.traces``, README-predictor.md).

The prompts are Python sources of installed packages (``torch`` by default; ``sglang`` and the
stdlib as fall-backs), concatenated file by file in sorted order and cut to an exact token count
with the model's own tokenizer, so a rerun gives the same prompts on the same package versions.

    PYTHONPATH=. python3 benchmarks/record_real_traces.py --out benchmarks/results/real_traces
    PYTHONPATH=. python3 benchmarks/bench_predictor.py --trace benchmarks/results/real_traces \\
        --per-layer --k 16 --deltas 1,1.5,2 --out benchmarks/results/real_traces_predictor

Defaults: 4 prompts of 4200-5400 tokens, 128 decode steps, block 16, top-K 16 blocks (about 6% of
the 262-338 blocks), layers 0,10,20,29; about 3 minutes on a 2-core CPU (4 requests batched).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import List

import requests

REPO = Path(__file__).resolve().parents[1]


def package_dir(name: str):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def source_texts(packages: List[str], n: int, min_chars: int) -> List[tuple]:
    """``n`` texts of at least ``min_chars`` characters: consecutive .py files (sorted paths) of a
    package subtree each, e.g. torch/nn, torch/optim, ... (distinct subtrees -> distinct prompts)."""
    out = []
    for pkg in packages:
        root = package_dir(pkg)
        if root is None:
            continue
        subs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("_"))
        for sub in subs:
            files = sorted(sub.rglob("*.py"))
            text, names = "", []
            for f in files:
                try:
                    t = f.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if len(t) < 2000:  # skip tiny __init__ stubs
                    continue
                text += f"# file: {f.relative_to(root.parent)}\n{t}\n"
                names.append(str(f.relative_to(root.parent)))
                if len(text) >= min_chars:
                    break
            if len(text) >= min_chars:
                out.append((names, text))
            if len(out) == n:
                return out
    if len(out) < n:
        raise SystemExit(f"only {len(out)} source texts of {min_chars} chars found in {packages}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/real_traces"))
    ap.add_argument("--model-path", default=None, help="default: the converted SmolLM2 folder")
    ap.add_argument("--packages", default="torch,sglang,json")
    ap.add_argument("--prompt-tokens", default="4200,4600,5000,5400")
    ap.add_argument("--steps", type=int, default=128, help="decode steps per request")
    ap.add_argument("--layers", default="0,10,20,29")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=16, help="blocks")
    ap.add_argument("--min-context", type=int, default=512)
    ap.add_argument("--calib-queries", type=int, default=8)
    ap.add_argument("--concurrent", action="store_true", default=True,
                    help="send all prompts at once (one batch); --serial to send one by one")
    ap.add_argument("--serial", dest="concurrent", action="store_false")
    ap.add_argument("--start-timeout", type=float, default=900)
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer

    from sglang_prr.tools import models
    from sglang_prr.serving import harness

    model_path = args.model_path or str(models.ensure_smollm2_subprocess())
    tok = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    lens = [int(x) for x in args.prompt_tokens.split(",")]
    texts = source_texts(args.packages.split(","), len(lens), min_chars=4 * max(lens) + 8000)
    prompts, sources = [], []
    for n, (names, text) in zip(lens, texts):
        ids = tok.encode(text).ids
        if len(ids) < n:
            raise SystemExit(f"prompt from {names[0]} has {len(ids)} < {n} tokens")
        prompts.append(ids[:n])
        sources.append(names)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.npz"):
        old.unlink()
    ctx = max(lens) + args.steps + 64
    flags = ["--model-path", model_path,
             "--page-size", str(args.block_size), "--max-total-tokens", str(sum(lens) + 4096),
             "--max-running-requests", str(len(lens)), "--chunked-prefill-size", "2048",
             "--context-length", str(max(ctx, 8192)),
             "--random-seed", "0", "--log-level", "warning", "--skip-server-warmup",
             "--sleep-on-idle", "--mem-fraction-static", "0.95",
             "--prr-block-size", str(args.block_size), "--prr-top-k", str(args.top_k),
             "--prr-top-k-unit", "blocks", "--prr-min-context", str(args.min_context),
             "--prr-calib-queries", str(args.calib_queries),
             "--prr-trace-path", str(out.resolve()), "--prr-trace-layers", args.layers,
             "--prr-trace-max-steps", str(args.steps),
             # /health_generate probes are requests too and count against the recorder's bound;
             # leave room for them (their one-step traces, if any, are dropped below).
             "--prr-trace-max-requests", str(len(lens) + 16)]
    t0 = time.monotonic()
    server = harness.Server(flags, out / "server.log", name="record")
    results = []
    try:
        try:
            server.wait_ready(args.start_timeout)
        except harness.ServerError as e:
            raise SystemExit(str(e))
        url = server.url
        print(f"server up in {time.monotonic() - t0:.0f} s", flush=True)

        def gen(ids):
            body = {"input_ids": ids, "sampling_params": {
                "max_new_tokens": args.steps, "temperature": 0.0, "ignore_eos": True}}
            r = requests.post(url + "/generate", json=body, timeout=3600)
            r.raise_for_status()
            return r.json()

        t1 = time.monotonic()
        if args.concurrent:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(len(prompts)) as ex:
                results = list(ex.map(gen, prompts))
        else:
            results = [gen(p) for p in prompts]
        print(f"{len(prompts)} requests done in {time.monotonic() - t1:.0f} s", flush=True)
    finally:
        server.stop(grace_s=60)
    from sglang_prr.tools import traces as T

    files = []
    for f in sorted(out.glob("*.npz")):
        if T.load_trace(str(f)).steps < args.steps:  # a health probe or a cut request
            f.unlink()
        else:
            files.append(f)
    manifest = {"model_path": model_path, "command": server.cmd[1:], "prompt_tokens": lens,
                "steps": args.steps, "sources": [s[:3] + (["..."] if len(s) > 3 else [])
                                                 for s in sources],
                "outputs": [r.get("text", "")[:200] for r in results],
                "traces": [f.name for f in files], "wall_s": round(time.monotonic() - t0, 1)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(files)} traces in {out} ({sum(f.stat().st_size for f in files) / 1e6:.1f} MB), "
          f"{manifest['wall_s']} s total")
    return 0 if files else 1


if __name__ == "__main__":
    sys.exit(main())
