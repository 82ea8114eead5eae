"""Device code of moe-offload, installed as ``moe_offload.kernels`` (see DESIGN.md section 1).

Importing any module of this package touches no CUDA; kernels and runtime bindings resolve on first use.
"""
