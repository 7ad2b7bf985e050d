"""ragblend: bench."""
