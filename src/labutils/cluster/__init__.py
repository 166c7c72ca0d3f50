"""Runs across hosts: virtual hosts on one machine
(virtual; the namespaces, cables and link caps under it in netns, link rates and
their measurement in links), SLURM (slurm: the sbatch script in sbatch, the job in
slurm_job) and Kubernetes (kubernetes: the manifest in pytorchjob, its input checks
in pytorchjob_checks).

``from labutils.cluster import virtual_cluster`` is the lessons' entry point. The
names below load on first use: the virtual cluster imports the launcher, which this
package does not import itself.
"""

_HOME = {
    "VirtualCluster": "labutils.cluster.virtual", "virtual_cluster": "labutils.cluster.virtual",
    "clean_stale": "labutils.cluster.netns",
    "parse_rate": "labutils.cluster.links", "rate_text": "labutils.cluster.links",
}

__all__ = ["VirtualCluster", "virtual_cluster", "clean_stale", "parse_rate", "rate_text"]


def __getattr__(name: str):
    """A public name, from its module, loaded on first use (PEP 562)."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value
