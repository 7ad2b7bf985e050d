"""What the KV store costs and saves, an engine and a store in this process:

- `kv`: `ragblend bench kv`, blend TTFT per tier (memory, disk, Redis), pipelined or not, and the
  loading planner's plans (`--throttle-mbps` for slow tiers);
- `codec`: `ragblend bench kv-codec`, the entry formats at rest (bytes per token, speed, fidelity);
- `corpus`: `ragblend bench corpus`, the collection's KV budget at corpus scale (hit rate, TTFT).
"""
