"""Runs across hosts: interface choice (network), virtual hosts on one machine
(virtual), SLURM (slurm) and Kubernetes (kubernetes).

``from labutils.cluster import virtual_cluster`` is the lessons' entry point.
"""

from labutils.cluster.virtual import (
    VirtualCluster,
    clean_stale,
    parse_rate,
    rate_text,
    virtual_cluster,
)

__all__ = ["VirtualCluster", "virtual_cluster", "clean_stale", "parse_rate", "rate_text"]
