"""keras_meshlayout: named meshes and checked layout rules for Keras on JAX.

Example:
    >>> import keras_meshlayout as kml
    >>> kml.emulate_devices(8)
    >>> mesh = kml.Mesh.parse("2x4")
    >>> rules = kml.LayoutRules([(r".*dense_1/kernel", (None, "model"))])
    >>> dist = kml.ModelParallel(mesh, rules, batch_axis="data")
"""

import importlib.metadata
import os

if "keras" not in __import__("sys").modules:
    # The backend is fixed at Keras's first import: choose JAX unless told otherwise.
    os.environ.setdefault("KERAS_BACKEND", "jax")

from ._auto import auto_rules as auto_rules
from ._backend import emulate_devices as emulate_devices
from ._budget import PlanCost as PlanCost
from ._budget import UnitChoice as UnitChoice
from ._checkpoint import LayoutChange as LayoutChange
from ._checkpoint import PlanDiff as PlanDiff
from ._checkpoint import ResumableCheckpoint as ResumableCheckpoint
from ._checkpoint import load_checkpoint as load_checkpoint
from ._checkpoint import plan_diff as plan_diff
from ._checkpoint import save_checkpoint as save_checkpoint
from ._comm import CommReport as CommReport
from ._comm import Transfer as Transfer
from ._comm import comm_report as comm_report
from ._distribution import ModelParallel as ModelParallel
from ._dry import dry_build as dry_build
from ._dry import dry_plan as dry_plan
from ._errors import CheckpointError as CheckpointError
from ._errors import DevicesAlreadyInitializedError as DevicesAlreadyInitializedError
from ._errors import GroupedConvWarning as GroupedConvWarning
from ._errors import IndivisibleBatchError as IndivisibleBatchError
from ._errors import IndivisibleShapeError as IndivisibleShapeError
from ._errors import IndivisibleShapeWarning as IndivisibleShapeWarning
from ._errors import InvalidMeshError as InvalidMeshError
from ._errors import InvalidOptionError as InvalidOptionError
from ._errors import InvalidRuleError as InvalidRuleError
from ._errors import MemoryBudgetError as MemoryBudgetError
from ._errors import MeshLayoutError as MeshLayoutError
from ._errors import MeshLayoutWarning as MeshLayoutWarning
from ._errors import RankMismatchError as RankMismatchError
from ._errors import UnmatchedRuleWarning as UnmatchedRuleWarning
from ._errors import UnsupportedBackendError as UnsupportedBackendError
from ._hub import rules_from_layout_map as rules_from_layout_map
from ._memory import MemoryEstimate as MemoryEstimate
from ._memory import check_plan as check_plan
from ._mesh import Mesh as Mesh
from ._mesh import ProcessSplitWarning as ProcessSplitWarning
from ._mesh import process_layout as process_layout
from ._multiprocess import ProcessInfo as ProcessInfo
from ._multiprocess import initialize as initialize
from ._multiprocess import local_batch_size as local_batch_size
from ._multiprocess import process_slice as process_slice
from ._multiprocess import save_weights as save_weights
from ._pictures import Picture as Picture
from ._pictures import ShardBlock as ShardBlock
from ._pictures import plot_plan as plot_plan
from ._pictures import sharding_blocks as sharding_blocks
from ._pictures import show_mesh as show_mesh
from ._pictures import show_sharding as show_sharding
from ._plan import Plan as Plan
from ._plan import plan_model as plan_model
from ._presets import conv_rules as conv_rules
from ._presets import mlp_rules as mlp_rules
from ._presets import transformer_rules as transformer_rules
from ._resolve import DEFAULT_REPLICATE_BELOW as DEFAULT_REPLICATE_BELOW
from ._resolve import Resolution as Resolution
from ._rules import LayoutRules as LayoutRules
from ._rules import Rule as Rule

__version__ = importlib.metadata.version("keras_meshlayout")

__all__ = [
    "CheckpointError",
    "LayoutChange",
    "PlanDiff",
    "ResumableCheckpoint",
    "load_checkpoint",
    "plan_diff",
    "save_checkpoint",
    "CommReport",
    "Transfer",
    "comm_report",
    "DEFAULT_REPLICATE_BELOW",
    "DevicesAlreadyInitializedError",
    "GroupedConvWarning",
    "IndivisibleBatchError",
    "IndivisibleShapeError",
    "IndivisibleShapeWarning",
    "InvalidMeshError",
    "InvalidOptionError",
    "InvalidRuleError",
    "LayoutRules",
    "Mesh",
    "MemoryBudgetError",
    "MemoryEstimate",
    "MeshLayoutError",
    "MeshLayoutWarning",
    "ModelParallel",
    "Picture",
    "Plan",
    "ProcessInfo",
    "ProcessSplitWarning",
    "RankMismatchError",
    "Resolution",
    "Rule",
    "ShardBlock",
    "UnmatchedRuleWarning",
    "UnsupportedBackendError",
    "auto_rules",
    "check_plan",
    "dry_build",
    "dry_plan",
    "conv_rules",
    "emulate_devices",
    "initialize",
    "local_batch_size",
    "process_layout",
    "process_slice",
    "save_weights",
    "mlp_rules",
    "plot_plan",
    "sharding_blocks",
    "show_mesh",
    "show_sharding",
    "plan_model",
    "rules_from_layout_map",
    "transformer_rules",
    "PlanCost",
    "UnitChoice",
]
