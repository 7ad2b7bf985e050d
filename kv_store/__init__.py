"""ragblend: kv_store."""
