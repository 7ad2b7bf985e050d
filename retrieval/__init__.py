"""ragblend: retrieval."""
