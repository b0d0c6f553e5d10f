"""The automatic planner, as stages with typed, immutable hand-offs.

1. `trace_model` (`_trace`): the forward pass traced on abstract values into a
   flat dataflow graph, a `Trace`, whose inputs are the model's variables.
2. `find_units` (`_units`): the weights that split over the model axis together
   (column → row projection pairs, attention heads), as `Unit`s, read off the
   dataflow whatever style wrote the model: one split grown operation by
   operation (`_grower`), through loops' bodies (`_scan`) and grouped or depthwise
   convolutions (`_grouped`). The rule writer runs its
   strategies, in the order `_auto.STRATEGIES` lists them, over one ledger
   (`_ledger.Ledger`: one decision per variable, `record(path, axes, note,
   unit)`): Keras layers (`_by_layers`), names (`_by_name`, with
   `_presets`), the traced units (`_by_trace`), look-up tables
   (`_embeddings`), expert banks (`_experts`), convolutions' channels
   (`_convs`), LoRA adapters (`_lora`), int8 scales (`_quantized`); every note text is in
   `_notes`. The ledger's decisions, frozen, are the `Proposal`: per variable
   its tensor-parallel axes, note and unit.
3. `cost_units` (`_costs`, over `_candidates` (with `_batch_gathers`), `_one_weight`, `_kv_costs`,
   `_table_costs` and `_conv_costs`, with `_batch_sums`: how often XLA sums each
   gradient over the batch axis, read off the trace): per unit,
   its candidate layouts (replicated, tensor-parallel, 2-D, vocab-parallel,
   ...), each a `Candidate` with its bytes per device (the one memory model,
   `core._memory.SlotModel`) and its bytes on the wire per step (the ring
   formulas of `kml.comm_report`, `report._collectives`), in a `CostTable`.
   `_peak`: the per-device peak of one training step (`trace_step`, forward
   and backward, walked under the candidates' layouts: what XLA fuses,
   `_fusion`; liveness, `_liveness`: activations, temporaries, gradients
   written so far), what the budget is compared with;
   on a TPU target, less what XLA:TPU keeps on chip and plus its tiles' padding and (v5p) alignment
   (`_tpu_memory`).
4. `search` (`_search`): per unit, the index of the candidate at the least
   traffic within the memory budget (the proposal's own without one), and
   `plan_cost`, the public `kml.PlanCost`; `_auto` runs it again with a larger
   activation reserve until the chosen layouts' predicted peak fits.
5. Rules (`_auto`): the chosen candidates become one exact rule per variable,
   each with a note that says why.
6. The mesh (`_mesh_choice`): `choose_mesh` runs 1 → 5 on every data × model split
   of a device count or TPU target, twice where `data` ≥ 2 (the least-traffic plan and
   the fully sharded one, every unit at its layout of least state), and ranks them by
   predicted step time, with each device's FLOPs from `_flops` and the splits, and their
   bytes within a slice (ICI) and between slices (DCN), from `_mesh_splits`.
7. The compile check (`_compiled_plan`): `plan_and_compile` runs 1 → 5 for one batch,
   compiles the model's training step for the plan (`kml.compile_step`), and plans again
   under a tighter budget while XLA's compiled peak is over the memory budget.

Imports run one way, 1 → 7: no stage imports a later one
(`tests/test_planning.py` holds the module order).
"""

from ..core._grouped_scan import abstract_batch as abstract_batch
from ._candidates import Candidate as Candidate
from ._candidates import CostTable as CostTable
from ._candidates import UnitCosts as UnitCosts
from ._costs import cost_units as cost_units
from ._ledger import Proposal as Proposal
from ._search import plan_cost as plan_cost
from ._search import search as search
from ._trace import Node as Node
from ._trace import Trace as Trace
from ._trace import Use as Use
from ._trace import trace_model as trace_model
from ._units import Member as Member
from ._units import Unit as Unit
from ._units import find_added as find_added
from ._units import find_units as find_units

__all__ = [
    "Candidate",
    "CostTable",
    "Member",
    "Node",
    "Proposal",
    "Trace",
    "Unit",
    "UnitCosts",
    "Use",
    "abstract_batch",
    "cost_units",
    "find_added",
    "find_units",
    "plan_cost",
    "search",
    "trace_model",
]
