"""Samplers: one module per source (nvml, dcgm, server, host) behind one Sampler protocol."""
