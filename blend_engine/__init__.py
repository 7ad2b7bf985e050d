"""CacheBlend engine: precompute chunk KV, fuse it with selective recompute, decode."""
