"""keras_meshlayout: named meshes and checked layout rules for Keras on JAX.

Example:
    >>> import keras_meshlayout as kml
    >>> kml.emulate_devices(8)
    >>> mesh = kml.Mesh.parse("2x4")
    >>> rules = kml.LayoutRules([(r".*dense_1/kernel", (None, "model"))])
    >>> dist = kml.ModelParallel(mesh, rules, batch_axis="data")
"""

import importlib
import importlib.metadata
import os

if "keras" not in __import__("sys").modules:
    # The backend is fixed at Keras's first import: choose JAX unless told otherwise.
    os.environ.setdefault("KERAS_BACKEND", "jax")

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names, for type checkers and the docs; at run time each loads on first use
    from .checkpoint._load import load_checkpoint as load_checkpoint
    from .checkpoint._plan_diff import LayoutChange as LayoutChange
    from .checkpoint._plan_diff import PlanDiff as PlanDiff
    from .checkpoint._plan_diff import plan_diff as plan_diff
    from .checkpoint._resume import ResumableCheckpoint as ResumableCheckpoint
    from .checkpoint._save import save_checkpoint as save_checkpoint
    from .checkpoint._weights import save_weights as save_weights
    from .core._backend import emulate_devices as emulate_devices
    from .core._distribution import ModelParallel as ModelParallel
    from .core._dry import dry_build as dry_build
    from .core._dry import dry_plan as dry_plan
    from .core._errors import CheckpointError as CheckpointError
    from .core._errors import DevicesAlreadyInitializedError as DevicesAlreadyInitializedError
    from .core._errors import GroupedConvWarning as GroupedConvWarning
    from .core._errors import HloFormatError as HloFormatError
    from .core._errors import IndivisibleBatchError as IndivisibleBatchError
    from .core._errors import IndivisibleShapeError as IndivisibleShapeError
    from .core._errors import IndivisibleShapeWarning as IndivisibleShapeWarning
    from .core._errors import InvalidMeshError as InvalidMeshError
    from .core._errors import InvalidOptionError as InvalidOptionError
    from .core._errors import InvalidRuleError as InvalidRuleError
    from .core._errors import InvalidTargetError as InvalidTargetError
    from .core._errors import LayoutMismatchError as LayoutMismatchError
    from .core._errors import LayoutMismatchWarning as LayoutMismatchWarning
    from .core._errors import MemoryBudgetError as MemoryBudgetError
    from .core._errors import MeshLayoutError as MeshLayoutError
    from .core._errors import MeshLayoutWarning as MeshLayoutWarning
    from .core._errors import MissingLibtpuError as MissingLibtpuError
    from .core._errors import RankMismatchError as RankMismatchError
    from .core._errors import UnmatchedRuleWarning as UnmatchedRuleWarning
    from .core._errors import UnsupportedBackendError as UnsupportedBackendError
    from .core._layout_map import rules_from_layout_map as rules_from_layout_map
    from .core._memory import MemoryEstimate as MemoryEstimate
    from .core._memory import check_plan as check_plan
    from .core._mesh import Mesh as Mesh
    from .core._placement import ProcessSplitWarning as ProcessSplitWarning
    from .core._placement import process_layout as process_layout
    from .core._plan import Plan as Plan
    from .core._planning import plan_model as plan_model
    from .core._plot import plot_plan as plot_plan
    from .core._policy import LayoutPolicy as LayoutPolicy
    from .core._process_data import local_batch_size as local_batch_size
    from .core._process_data import process_slice as process_slice
    from .core._resolve import DEFAULT_REPLICATE_BELOW as DEFAULT_REPLICATE_BELOW
    from .core._resolve import Resolution as Resolution
    from .core._rules import LayoutRules as LayoutRules
    from .core._rules import Rule as Rule
    from .core._targets import Target as Target
    from .core._targets import parse_target as parse_target
    from .planner._at_peak import PeakBuffer as PeakBuffer
    from .planner._auto import auto_rules as auto_rules
    from .planner._compiled_plan import CompiledPlan as CompiledPlan
    from .planner._compiled_plan import plan_and_compile as plan_and_compile
    from .planner._mesh_choice import MeshChoice as MeshChoice
    from .planner._mesh_choice import MeshOption as MeshOption
    from .planner._mesh_choice import choose_mesh as choose_mesh
    from .planner._presets import conv_rules as conv_rules
    from .planner._presets import mlp_rules as mlp_rules
    from .planner._presets import transformer_rules as transformer_rules
    from .planner._search import PlanCost as PlanCost
    from .planner._search import UnitChoice as UnitChoice
    from .report._comm import CommReport as CommReport
    from .report._comm import Transfer as Transfer
    from .report._comm import comm_report as comm_report
    from .report._compile import CompiledStep as CompiledStep
    from .report._compile import compile_step as compile_step
    from .report._pictures import Picture as Picture
    from .report._pictures import ShardBlock as ShardBlock
    from .report._pictures import sharding_blocks as sharding_blocks
    from .report._pictures import show_mesh as show_mesh
    from .report._pictures import show_sharding as show_sharding
    from .runtime._initialize import ProcessInfo as ProcessInfo
    from .runtime._initialize import initialize as initialize

#: Each public name and the private module that defines it. Importing the package loads none of
#: them, so `import keras_meshlayout` (and the command line's `--help`) imports neither Keras nor
#: JAX; `kml.NAME` imports its module on first use (`tests/test_public_api.py` checks both lists).
_LAZY = {
    "load_checkpoint": "checkpoint._load",
    "LayoutChange": "checkpoint._plan_diff",
    "PlanDiff": "checkpoint._plan_diff",
    "plan_diff": "checkpoint._plan_diff",
    "ResumableCheckpoint": "checkpoint._resume",
    "save_checkpoint": "checkpoint._save",
    "save_weights": "checkpoint._weights",
    "emulate_devices": "core._backend",
    "ModelParallel": "core._distribution",
    "dry_build": "core._dry",
    "dry_plan": "core._dry",
    "CheckpointError": "core._errors",
    "DevicesAlreadyInitializedError": "core._errors",
    "GroupedConvWarning": "core._errors",
    "HloFormatError": "core._errors",
    "IndivisibleBatchError": "core._errors",
    "IndivisibleShapeError": "core._errors",
    "IndivisibleShapeWarning": "core._errors",
    "InvalidMeshError": "core._errors",
    "InvalidOptionError": "core._errors",
    "InvalidRuleError": "core._errors",
    "InvalidTargetError": "core._errors",
    "LayoutMismatchError": "core._errors",
    "LayoutMismatchWarning": "core._errors",
    "MemoryBudgetError": "core._errors",
    "MeshLayoutError": "core._errors",
    "MeshLayoutWarning": "core._errors",
    "MissingLibtpuError": "core._errors",
    "RankMismatchError": "core._errors",
    "UnmatchedRuleWarning": "core._errors",
    "UnsupportedBackendError": "core._errors",
    "rules_from_layout_map": "core._layout_map",
    "MemoryEstimate": "core._memory",
    "check_plan": "core._memory",
    "Mesh": "core._mesh",
    "ProcessSplitWarning": "core._placement",
    "process_layout": "core._placement",
    "Plan": "core._plan",
    "plan_model": "core._planning",
    "plot_plan": "core._plot",
    "LayoutPolicy": "core._policy",
    "local_batch_size": "core._process_data",
    "process_slice": "core._process_data",
    "DEFAULT_REPLICATE_BELOW": "core._resolve",
    "Resolution": "core._resolve",
    "LayoutRules": "core._rules",
    "Rule": "core._rules",
    "Target": "core._targets",
    "parse_target": "core._targets",
    "auto_rules": "planner._auto",
    "CompiledPlan": "planner._compiled_plan",
    "plan_and_compile": "planner._compiled_plan",
    "MeshChoice": "planner._mesh_choice",
    "MeshOption": "planner._mesh_choice",
    "choose_mesh": "planner._mesh_choice",
    "conv_rules": "planner._presets",
    "mlp_rules": "planner._presets",
    "transformer_rules": "planner._presets",
    "PeakBuffer": "planner._at_peak",
    "PlanCost": "planner._search",
    "UnitChoice": "planner._search",
    "CommReport": "report._comm",
    "Transfer": "report._comm",
    "comm_report": "report._comm",
    "CompiledStep": "report._compile",
    "compile_step": "report._compile",
    "Picture": "report._pictures",
    "ShardBlock": "report._pictures",
    "sharding_blocks": "report._pictures",
    "show_mesh": "report._pictures",
    "show_sharding": "report._pictures",
    "ProcessInfo": "runtime._initialize",
    "initialize": "runtime._initialize",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_meshlayout' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


try:
    __version__ = importlib.metadata.version("keras_meshlayout")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

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
    "CompiledStep",
    "compile_step",
    "DEFAULT_REPLICATE_BELOW",
    "DevicesAlreadyInitializedError",
    "GroupedConvWarning",
    "HloFormatError",
    "LayoutMismatchError",
    "LayoutMismatchWarning",
    "IndivisibleBatchError",
    "IndivisibleShapeError",
    "IndivisibleShapeWarning",
    "InvalidMeshError",
    "InvalidOptionError",
    "InvalidRuleError",
    "InvalidTargetError",
    "LayoutPolicy",
    "LayoutRules",
    "Mesh",
    "MemoryBudgetError",
    "MemoryEstimate",
    "MeshLayoutError",
    "MeshLayoutWarning",
    "MissingLibtpuError",
    "ModelParallel",
    "Picture",
    "Plan",
    "ProcessInfo",
    "ProcessSplitWarning",
    "RankMismatchError",
    "Resolution",
    "Rule",
    "ShardBlock",
    "Target",
    "UnmatchedRuleWarning",
    "UnsupportedBackendError",
    "auto_rules",
    "plan_and_compile",
    "CompiledPlan",
    "choose_mesh",
    "MeshChoice",
    "MeshOption",
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
    "parse_target",
    "plan_model",
    "rules_from_layout_map",
    "transformer_rules",
    "PlanCost",
    "PeakBuffer",
    "UnitChoice",
]
