"""The worker's KV offload tiers (DESIGN.md section 10): KV blocks copied out of the cache
into host memory and files, and back in on a prefix hit (kv_offload_store.py)."""
