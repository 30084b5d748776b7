"""Neutral shared types: request records, the timeline and its clock, sampled series, GPU
clocks-event reasons, durations and byte sizes, the tracked metrics, the window summary.

Every other part of soakd may import these; nothing here imports any other part of soakd (a
test checks it), so the layers above meet only in types that belong to none of them.
"""
