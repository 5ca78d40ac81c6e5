"""A geo-distributed network on one machine: namespaces, shaped links, user-space delay, probes.

- `topology`: regions, per region pair RTT and bandwidth, hosts in regions (JSON files; pure).
- `network`: `EmulatedNetwork`, which builds and always tears down the namespaces and links.
- `delay_proxy`: the transparent TCP proxy that adds latency (this kernel has no netem).
- `probe`: RTT and rate measured across an emulated link, checked against what was asked.
"""
