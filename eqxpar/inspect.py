"""Reading what a compiled step does: collective traffic and memory per device."""

from ._hlo import CollectiveStats as CollectiveStats, collective_stats as collective_stats, shape_bytes as shape_bytes
