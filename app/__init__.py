"""ragblend: app."""
