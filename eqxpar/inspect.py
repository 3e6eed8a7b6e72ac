"""Reading what a compiled step does: collective traffic and memory per device."""

from ._hlo import CollectiveStats as CollectiveStats
from ._hlo import collective_stats as collective_stats
from ._hlo import shape_bytes as shape_bytes
