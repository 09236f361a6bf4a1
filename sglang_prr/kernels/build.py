"""JIT build of the SM90 kernel library (FlashInfer-style): compile on first use, cache by hash.

The library is a plain shared object that registers ``torch.ops.sglang_prr_cuda.*`` through
``TORCH_LIBRARY`` (no Python extension module), so one built under one Python version loads under
another with the same torch. Environment:

* ``SGLANG_PRR_KERNEL_LIB``: path of a prebuilt library to load instead of building.
* ``SGLANG_PRR_CACHE_DIR``: cache root (default ``~/.cache/sglang_prr``).
* ``CUTLASS_INCLUDE_DIR``: CUTLASS/CuTe headers (default: the ``nvidia-cutlass`` wheel's).
* ``SGLANG_PRR_NVCC``: the nvcc to use (default: ``$CUDA_HOME/bin/nvcc`` or ``nvcc`` on PATH).
* ``SGLANG_PRR_DEBUG=1``: add ``-lineinfo`` and keep host assertions (debug builds only).
* ``SGLANG_PRR_PROBES=1``: compile the timing probes in (per-CTA timelines of the attention,
  ``SGLANG_PRR_ATTN_TIMELINE=1`` at run time, and of the one-pass selection,
  ``SGLANG_PRR_SELECT_TIMELINE=1``; ``benchmarks/bench_attn_timeline.py``,
  ``benchmarks/bench_select_timeline.py``); without it the kernels hold no probe code.
* ``SGLANG_PRR_BUILD_JOBS``: parallel compiler processes (default: number of CPUs; there are
  nine CUDA translation units and three host ones).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional

HERE = Path(__file__).resolve().parent
CUDA_SOURCES = ["attention.cu", "selection.cu", "select_predict.cu", "predictor.cu", "merge.cu",
                "sets.cu", "summaries.cu", "calib_kernels.cu", "infllm_kernels.cu", "probe.cu"]
HOST_SOURCES = ["binding.cpp", "select_binding.cpp", "infllm_binding.cpp"]
HEADERS = ["kernel_limits.h", "prr_kernels.h", "binding_common.h", "infllm_kernels.h", "common.cuh",
           "infllm_logits.cuh",
           "topk.cuh", "predict_row.cuh", "attn_block.cuh", "attn_merge.cuh", "probe.cuh"]
LIB_NAME = "libsglang_prr_kernels.so"
STAMP_NAME = "source_hash"  # beside a library built into a named folder

# Hopper only: sm_90a enables the arch-specific instructions; no PTX fallback is embedded, so a
# non-SM90 GPU keeps the reference path instead of JIT-compiling PTX at load time.
GENCODE = ["-gencode", "arch=compute_90a,code=sm_90a"]
# No --use_fast_math: the kernels are memory-bound and exp/log accuracy is part of the contract.
NVCC_FLAGS = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr",
              "-Xptxas=-warn-spills"]
CXX_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-Wno-unused-parameter"]


def cuda_home() -> Path:
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            return Path(os.environ[env])
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        if real.parent.name == "bin" and (real.parent.parent / "include" / "cuda_runtime.h").exists():
            return real.parent.parent
    return Path("/usr/local/cuda")


def nvcc_path() -> str:
    if os.environ.get("SGLANG_PRR_NVCC"):
        return os.environ["SGLANG_PRR_NVCC"]
    cand = cuda_home() / "bin" / "nvcc"
    if cand.exists():
        return str(cand)
    found = shutil.which("nvcc")
    if not found:
        raise RuntimeError("nvcc not found: set CUDA_HOME or SGLANG_PRR_NVCC")
    return found


def cutlass_include() -> Optional[str]:
    """The CUTLASS/CuTe include folder: ``CUTLASS_INCLUDE_DIR``, else the ``nvidia-cutlass``
    wheel's, else None. The wheel's package is located, not imported: importing
    ``cutlass_library`` parses the process's command line (``-h`` there prints its help and
    exits), whichever program is building."""
    if os.environ.get("CUTLASS_INCLUDE_DIR"):
        return os.environ["CUTLASS_INCLUDE_DIR"]
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        return None
    inc = Path(spec.origin).resolve().parent / "source" / "include"
    return str(inc) if inc.is_dir() else None


def _torch_includes() -> List[str]:
    import torch
    root = Path(torch.__file__).resolve().parent / "include"
    return [str(root), str(root / "torch" / "csrc" / "api" / "include")]


def _abi_flag() -> str:
    import torch
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def build_commands(out_dir: Path) -> List[List[str]]:
    """The compile commands (one per translation unit) and the link command, last."""
    debug = os.environ.get("SGLANG_PRR_DEBUG") == "1"
    probes = ["-DSGLANG_PRR_PROBES"] if os.environ.get("SGLANG_PRR_PROBES") == "1" else []
    nvcc = nvcc_path()
    inc = ["-I", str(HERE)]
    cut = cutlass_include()
    if cut:
        inc += ["-I", cut]
    cuda_inc = str(cuda_home() / "include")
    cmds = []
    objs = []
    for src in CUDA_SOURCES:
        obj = out_dir / (src + ".o")
        cmds.append([nvcc, *NVCC_FLAGS, *GENCODE, *(["-lineinfo"] if debug else ["-DNDEBUG"]),
                     *probes, *inc, "-c", str(HERE / src), "-o", str(obj)])
        objs.append(str(obj))
    cxx = os.environ.get("CXX", "g++")
    for src in HOST_SOURCES:
        obj = out_dir / (src + ".o")
        tinc = []
        for p in _torch_includes():
            tinc += ["-isystem", p]
        cmds.append([cxx, *CXX_FLAGS, _abi_flag(), *([] if debug else ["-DNDEBUG"]), *inc, *tinc,
                     "-isystem", cuda_inc, "-c", str(HERE / src), "-o", str(obj)])
        objs.append(str(obj))
    # nvcc links the CUDA runtime statically. torch's libraries are named by soname only (no
    # rpath): the loading process has them open already, wherever its torch is installed.
    import torch
    tlib = str(Path(torch.__file__).resolve().parent / "lib")
    cmds.append([nvcc, "-shared", *GENCODE, *objs, "-L", tlib, "-lc10_cuda", "-lc10",
                 "-ltorch_cpu", "-o", str(out_dir / LIB_NAME)])
    return cmds


def source_hash() -> str:
    h = hashlib.sha256()
    for name in CUDA_SOURCES + HOST_SOURCES + HEADERS:
        h.update(name.encode())
        h.update((HERE / name).read_bytes())
    import torch
    h.update(" ".join(NVCC_FLAGS + CXX_FLAGS + GENCODE).encode())
    h.update(torch.__version__.encode())
    h.update(os.environ.get("SGLANG_PRR_DEBUG", "0").encode())
    if os.environ.get("SGLANG_PRR_PROBES") == "1":
        h.update(b"probes")
    return h.hexdigest()[:16]


def library_tag() -> str:
    """Which library a process loads, for benchmark rows: the source hash stamped beside the
    library ``SGLANG_PRR_KERNEL_LIB`` names (one built into a named folder; its folder's name
    when unstamped), else the hash of these sources (the cached build)."""
    lib = os.environ.get("SGLANG_PRR_KERNEL_LIB")
    if lib:
        stamp = Path(lib).parent / STAMP_NAME
        return stamp.read_text().strip() if stamp.exists() else Path(lib).parent.name
    return source_hash()


def cache_dir(key: Optional[str] = None) -> Path:
    """The cache folder of the library built from these sources (``key``: their hash, if known)."""
    root = os.environ.get("SGLANG_PRR_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "sglang_prr")
    return Path(root) / "kernels" / (key or source_hash())


def _run(cmd: List[str]) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"kernel build failed ({proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-6000:]}")


def build(out_dir: Optional[Path] = None, verbose: bool = False) -> Path:
    """Compile the library into ``out_dir`` (default: the hash-keyed cache dir); returns its path.

    The build runs in a private temp dir and is moved into place atomically, so concurrent
    processes never load a half-written library.
    """
    want = source_hash()  # once: it reads every source
    final_dir = Path(out_dir) if out_dir is not None else cache_dir(want)
    final = final_dir / LIB_NAME
    # A named output folder keeps the hash of the sources it was built from: a library built
    # from other sources is rebuilt, never returned as if it were current.
    stamp = final_dir / STAMP_NAME
    if final.exists() and (out_dir is None or (stamp.exists() and stamp.read_text() == want)):
        return final
    final_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final_dir, prefix=".build-") as tmp:
        tmp_dir = Path(tmp)
        cmds = build_commands(tmp_dir)
        jobs = int(os.environ.get("SGLANG_PRR_BUILD_JOBS", os.cpu_count() or 1))
        if verbose:
            for c in cmds:
                print(" ".join(c), file=sys.stderr)
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
            list(ex.map(_run, cmds[:-1]))
        _run(cmds[-1])
        os.replace(tmp_dir / LIB_NAME, final)
    stamp.write_text(want)
    return final


def library_path() -> Path:
    """The library to load: ``SGLANG_PRR_KERNEL_LIB`` if set, else the cached (or fresh) build."""
    pre = os.environ.get("SGLANG_PRR_KERNEL_LIB")
    if pre:
        p = Path(pre)
        if not p.exists():
            raise RuntimeError(f"SGLANG_PRR_KERNEL_LIB={pre!r} does not exist")
        return p
    return build()


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m sglang_prr.kernels.build [OUT_DIR]``: build (or find current) and print the
    library's path."""
    p = argparse.ArgumentParser(prog="python -m sglang_prr.kernels.build",
                                description="Compile the SM90 kernel library and print its path.")
    p.add_argument("out_dir", nargs="?", type=Path,
                   help="folder for the library and its source hash (default: the hash-keyed "
                        "cache, SGLANG_PRR_CACHE_DIR)")
    args = p.parse_args(argv)
    print(build(args.out_dir, verbose=True))


if __name__ == "__main__":
    main()
