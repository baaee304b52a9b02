"""Benchmarks: what AAH windows cost and save in attention time and FLOPs.

``aah bench attention`` (:mod:`aah.bench.attention`) times every attention
backend against full causal SDPA on one layer's worth of attention, with the
paper's window mixes (AAH-v3 paper, section 7.7: backend-realized local
attention and FLOPs diagnostics).
"""
