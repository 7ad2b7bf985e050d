"""The settings' enums (configs.enums) and the server's whole settings (configs.settings, imported by the edge only)."""
