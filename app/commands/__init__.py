"""ragblend: app/commands."""
