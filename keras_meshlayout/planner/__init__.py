"""The automatic planner, as stages with typed, immutable hand-offs.

1. `trace_model` (`_trace`): the forward pass traced on abstract values into a
   flat dataflow graph, a `Trace`, whose inputs are the model's variables.
2. `find_units` (`_units`): the weights that split over the model axis together
   (column → row projection pairs, attention heads), as `Unit`s, read off the
   dataflow whatever style wrote the model.
3. Costs and search (`keras_meshlayout.planner._budget`): per unit, the layout that fits
   a memory budget at the least traffic.
4. Rules (`keras_meshlayout.planner._auto`): one exact rule per variable, with a note.
"""

from ._trace import Node as Node
from ._trace import Trace as Trace
from ._trace import Use as Use
from ._trace import abstract_batch as abstract_batch
from ._trace import trace_model as trace_model
from ._units import Member as Member
from ._units import Unit as Unit
from ._units import find_added as find_added
from ._units import find_units as find_units

__all__ = [
    "Member",
    "Node",
    "Trace",
    "Unit",
    "Use",
    "abstract_batch",
    "find_added",
    "find_units",
    "trace_model",
]
