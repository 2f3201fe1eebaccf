"""Adapters that let other serving stacks use pdserve's KV store (docs/lmcache.md)."""
