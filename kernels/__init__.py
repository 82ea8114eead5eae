"""Device code of moe-offload, installed as ``moe_offload.kernels`` (pyproject.toml maps the top-level ``kernels/`` directory to it).

Importing any module of this package touches no CUDA; kernels and runtime bindings resolve on first use.
"""
