"""Developer tools that read the source tree (no service imports them)."""
