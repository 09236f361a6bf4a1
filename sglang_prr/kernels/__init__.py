"""SM90 CUDA kernels for the PRR ops (sources beside this file, JIT-built on first use)."""
