"""Reading what a plan and a compiled step do: where every array lives, the
collective traffic beside its theoretical minimum, memory per device, and
pictures of array layouts.

Inside: `_table` (`sharding_table`), `_compiled` (a Step, Lowered or Compiled
turned into one executable), `_hlo` (collective counts and bytes read from
compiled HLO), `_overlap` (`overlap_stats`: the part of that traffic the
schedule overlaps with compute), `_minimum` (the theoretical minimum of communication of a plan),
`_report` (`comm_report`: the two side by side), `_memory` (`memory_report`),
`_flops` (`matmul_flops`: matmul FLOPs per device, loops weighted) and
`_layout` (text and PNG pictures of an array's layout over the devices) and
`_trace` (`trace`: a profiler trace of a few steps).
"""

from ._flops import matmul_flops as matmul_flops
from ._hlo import CollectiveStats as CollectiveStats
from ._hlo import collective_stats as collective_stats
from ._hlo import shape_bytes as shape_bytes
from ._layout import layout as layout
from ._layout import save_layout_png as save_layout_png
from ._memory import MemoryReport as MemoryReport
from ._memory import memory_report as memory_report
from ._minimum import Cost as Cost
from ._minimum import Minimum as Minimum
from ._minimum import minimum_comm as minimum_comm
from ._overlap import OverlapStats as OverlapStats
from ._overlap import overlap_stats as overlap_stats
from ._report import CommReport as CommReport
from ._report import comm_report as comm_report
from ._table import Row as Row
from ._table import ShardingTable as ShardingTable
from ._table import sharding_table as sharding_table
from ._trace import trace as trace
