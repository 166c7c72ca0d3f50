"""Lesson 06 beyond one machine: readings of the two-node runs (which rank ran where,
the bytes that crossed each host's link, the interface gloo chose) and the recipes that
start one job on several nodes (node commands, the compose file's node services).

lesson06.py imports these for the notebook (L.node_commands); the rank scripts do not.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from labutils.course.tables import text_table

REPO = Path(__file__).resolve().parents[2]  # the course folder: lessons/, docker/, src/


def rank_node_table(records: list[dict]) -> str:
    """Per rank: the node it ran on (GROUP_RANK), LOCAL_RANK, and the rule torchrun's static
    rendezvous numbers ranks by (node rank x ranks per node + local rank)."""
    rows = []
    for r in sorted(records, key=lambda r: r["rank"]):
        rule = r["group_rank"] * r["local_world_size"] + r["local_rank"]
        rows.append([r["rank"], r["group_rank"], r["local_rank"], r["local_world_size"],
                     r["world_size"], f"{rule} {'ok' if rule == r['rank'] else 'DIFFERS'}",
                     f"{r['sum']:g}"])
    return text_table(["RANK", "GROUP_RANK (node)", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                       "WORLD_SIZE", "node x LOCAL_WORLD_SIZE + LOCAL_RANK", "sum"], rows)


def ring_bytes_per_direction(records: list[dict]) -> int:
    """What a ring all-reduce must move across the cable in each direction, for a
    2-node run.

    Every rank sends 2(n-1)/n of the payload per all_reduce (lesson 02) to its right-hand
    neighbour in the ring 0 -> 1 -> ... -> n-1 -> 0. With ranks numbered node by node,
    exactly one ring link goes from node 0 to node 1 (node 0's last rank to node 1's
    first) and one back (node 1's last rank to rank 0), so each direction carries one
    rank's share.
    """
    first = records[0]
    n = first["world_size"]
    return first["steps"] * first["payload_bytes"] * 2 * (n - 1) // n


def bytes_crossed(cluster, before: dict, after: dict, records: list[dict]) -> str:
    """Host 0's link counters over the run against the ring all-reduce's payload."""
    first = records[0]
    n, mib = first["world_size"], first["payload_bytes"] / 2**20
    expected = ring_bytes_per_direction(records)
    lines = [f"payload: {first['steps']} all_reduce calls of {mib:g} MiB on {n} ranks; each rank "
             f"sends 2(n-1)/n x {mib:g} MiB = {2 * (n - 1) / n * mib:g} MiB per call",
             f"expected across the link, each direction: {expected:,} bytes "
             f"({expected / 2**20:.2f} MiB)"]
    if cluster.mode != "namespaces":
        return "\n".join(lines + ["measured: nothing to count, both hosts shared this machine's "
                                   "loopback (run as root to get network namespaces and links)"])
    for what, key in (("host 0 -> host 1", "tx_bytes"), ("host 1 -> host 0", "rx_bytes")):
        got = after[key] - before[key]
        lines.append(f"measured {what}: {got:,} bytes ({got / 2**20:.2f} MiB), "
                     f"{got / expected - 1:+.1%} over the payload")
    packets = after["tx_packets"] - before["tx_packets"]
    lines.append(f"(the extra: TCP/IP headers of {packets} packets, acknowledgements, "
                 "the rendezvous and gloo's connection set-up)")
    return "\n".join(lines)


def bytes_claim(cluster, before: dict, after: dict, records: list[dict]) -> str:
    """Whether each direction of host 0's link carried the ring's share, plus at most 3%
    of packet headers and set-up (and never less)."""
    if cluster.mode != "namespaces":
        return "no link to count on loopback"
    expected = ring_bytes_per_direction(records)
    ok = all(1.0 <= (after[k] - before[k]) / expected <= 1.03 for k in ("tx_bytes", "rx_bytes"))
    return ("each direction of host 0's link carried one rank's ring share, 2(n-1)/n of the "
            f"payload per call, plus under 3%: {ok}")


def interfaces_used(records: list[dict], cluster) -> str:
    """Per node: whether the launcher pointed gloo (GLOO_SOCKET_IFNAME) at that host's own
    link; on loopback, the value it set."""
    by_node: dict[int, set[str]] = {}
    for r in records:
        by_node.setdefault(r["group_rank"], set()).add(r["ifname"] or "(unset: gloo's own choice)")
    if cluster.mode != "namespaces":
        return "\n".join(f"node {node}: GLOO_SOCKET_IFNAME={', '.join(sorted(names))}"
                         for node, names in sorted(by_node.items()))
    return "\n".join(f"node {node}: GLOO_SOCKET_IFNAME names host {node}'s own link: "
                     f"{names == {cluster.interfaces[node]}}" for node, names in sorted(by_node.items()))


def refused_loopback(run) -> str:
    """For a run with GLOO_SOCKET_IFNAME=lo: whether it failed to start, and whether a
    rank's error says it was refused at 127.0.0.1 (its own machine)."""
    refused = [r.rank for r in run.ranks
               if "Connection refused" in r.stderr and "remote=[127.0.0.1]" in r.stderr]
    return "\n".join([
        f"the job got past init_process_group: {any('sum' in rec for rec in run.records)}",
        f"a rank was refused connecting to 127.0.0.1, its own machine: {bool(refused)}",
    ])


def first_error(run) -> str:
    """A rank's 'connectFullMesh failed' line, build paths shortened: the first rank that
    was refused ("Connection refused"), else the first rank that raised it at all (a rank
    whose peers gave up first fails with another message)."""
    from labutils.runtime.runfiles import shorten_build_paths

    found = [(r.rank, line) for r in run.ranks for line in r.stderr.splitlines()
             if line.startswith("RuntimeError") and "connectFullMesh" in line]
    refused = [(rank, line) for rank, line in found if "Connection refused" in line]
    if not (refused or found):
        return "no rank raised connectFullMesh's error"
    rank, line = (refused or found)[0]
    return f"rank {rank}: {shorten_build_paths(line)}"


def node_commands(script: str, *, nnodes: int, nproc: int, endpoint: str, rdzv_id: str,
                  log_dir: str, ifname: str) -> str:
    """The `labutils launch` command each machine runs for one job, with its environment.

    Args:
        script: the training script, at the same path on every machine.
        nnodes: machines; each runs the same command with its own --node-rank.
        nproc: ranks per machine.
        endpoint: HOST:PORT of node 0, reachable from every machine.
        rdzv_id: the job's name; the run folder is LOG_DIR/RDZV_ID.
        log_dir: a folder every machine shares (NFS, Lustre, ...), so every node shows
            every rank.
        ifname: the network interface the ranks should use on every machine.
    """
    blocks = []
    for node in range(nnodes):
        words = ["labutils", "launch", "-n", str(nproc), "--nnodes", str(nnodes),
                 "--node-rank", str(node), "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
                 "--log-dir", log_dir, script]
        blocks.append(f"# machine {node}\n"
                      f"export GLOO_SOCKET_IFNAME={ifname} NCCL_SOCKET_IFNAME={ifname} "
                      "NCCL_DEBUG=INFO\n" + shlex.join(words))
    return "\n".join(blocks)


def changed_lines(before: str, after: str) -> str:
    """The lines of after that are not in before (what a variant of a generated file adds)."""
    old = set(before.splitlines())
    return "\n".join(line for line in after.splitlines() if line not in old)


def compose_node_services() -> str:
    """docker/compose.yaml's node0 and node1 services as written in the file, and the words
    in which their commands differ."""
    import yaml

    text = (REPO / "docker" / "compose.yaml").read_text()
    services = yaml.safe_load(text)["services"]
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "node0:")
    end = next(i for i, line in enumerate(lines) if line.startswith("volumes:"))
    shown = "\n".join(lines[start:end]).rstrip()
    a, b = services["node0"]["command"], services["node1"]["command"]
    if len(a) != len(b):
        return f"{shown}\n\nnode0 and node1 commands differ in length"
    diff = [f"word {i}: {x!r} / {y!r}" for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return f"{shown}\n\nnode0 and node1 commands differ only in: {'; '.join(diff)}"
