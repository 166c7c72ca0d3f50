"""Helpers the lessons share: probes, timing, sharding, tables, self-checks, plots, and
the loader of a lesson folder's own modules (lesson)."""
