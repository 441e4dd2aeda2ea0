"""Test and benchmark harnesses for dlspark clusters (as ``distributed.utils_test`` is for Dask).

:func:`emulated_cluster` brings up workers on separate emulated hosts: one
network namespace per worker, joined by a bridge, each link rate-limited, with
real ``dask scheduler`` and ``dask worker`` processes. It needs root and
iproute2 (:func:`netns_unavailable` says why not); a delay between the hosts
needs iptables too (:func:`latency_unavailable`).
"""

from ._netcluster import (RATES, EmulatedCluster, emulated_cluster, latency_unavailable, leftovers, netns_unavailable,
                          parse_delay, parse_rate, sweep_leftovers, wait_for_workers)

__all__ = ["emulated_cluster", "EmulatedCluster", "netns_unavailable", "latency_unavailable", "sweep_leftovers",
           "leftovers", "parse_rate", "parse_delay", "wait_for_workers", "RATES"]
