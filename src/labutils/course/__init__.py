"""Helpers the lessons share: probes, timing, sharding, tables, self-checks, plots."""
