"""Costs of expert banks split on their expert dimension: what their all-reduces and routing send.

The mixin of `_costs._Coster` for the banks `_experts.expert_banks` splits: the
all-reduces of the experts' outputs and of their inputs' gradients over the axis the
banks are split over, the gradient of the routing weights, and on XLA:TPU the router
kernels' update, which it computes in the banks' shards and gathers back, and the routers'
gradients, summed over the batch axis in those shards (`tpu_router_shards`). Measured
against the compiled HLO on XLA:CPU (`tests/test_experts.py`) and XLA:TPU
(`tests/test_targets.py`).
"""

from __future__ import annotations

import math

import keras
import numpy as np

from ..core._axes import Axes
from ..report._collectives import wire_bytes
from ._candidates import add_wire, nbytes

__all__ = ["ExpertCosts"]


class ExpertCosts:
    """A mixin of `_costs._Coster`: the traffic of its expert-parallel units, read off its trace
    (`trace`, `uses`), mesh (`axis_sizes`, `d`, `model_axis`), proposal, optimizer's slot
    model (`memory`) and compiler."""

    def _expert_shards(self, axes: Axes) -> int:
        """How many ways an expert bank's weight split over the mesh's expert axis is sharded (else 1)."""
        axis = self.proposal.expert_axis
        return self.axis_sizes[axis] if axis is not None and axis in axes else 1

    def _expert_traffic(self, variables: list[keras.Variable], wire: dict[str, float]) -> None:
        """The all-reduces of an expert bank split on its expert dimension, added to `wire`.

        They run over the axis the bank is split over: the expert axis where the mesh has one
        (measured on XLA:CPU, a keras-hub Mixtral on `data=2,expert=2,model=2`), else the model axis.

        Measured on XLA:CPU (keras-hub Mixtral, QwenMoe, Qwen3Moe on 2×4 and
        4×2): forward, the batched projection over the experts (`eti,eih->eth`)
        gives each device its experts' outputs, and their weighted sum over
        the experts is one all-reduce of `(tokens, hidden)`; backward, each
        projection that reads the block's input (`th,ehm->etm`) all-reduces
        that input's gradient, and the gradient of the chosen experts'
        weights (`top_k`'s `(tokens, k)`) is all-reduced once.

        XLA:TPU also updates a replicated router kernel in the bank's shards (its gradient
        is split over the experts' axis as the logits are) and gathers back its new value
        and each optimizer slot: under Adam three all-gathers of the kernel per step
        (measured on v5e 2x4, keras-hub Mixtral on `data=4,model=2` and `data=2,expert=2,model=2`).
        """
        axis = self.proposal.expert_axis or self.model_axis
        size = self.axis_sizes[axis]
        if self.compiler == "tpu":
            for router in self._routers(variables):
                gathers = 1 + self.memory.like_parameter
                add_wire(wire, axis, gathers * wire_bytes("all-gather", nbytes(router), size))
        uses = [use for v in variables for use in self.uses.get(v.path, ()) if use.kind == "matmul"]
        merged = self.merged_input_grads([use for use in uses if 0 not in use.batch and not use.from_input])
        for variable in variables:
            for use in self.uses.get(variable.path, ()):
                if use.kind != "matmul":
                    continue
                if 0 in use.batch:
                    summed = math.prod(use.output[1:]) / self.d * max(np.dtype(use.dtype).itemsize, 4)
                    add_wire(wire, axis, wire_bytes("all-reduce", summed, size))
                    for choices in self._routing_choices(self.trace.nodes[use.node].outputs[0]):
                        add_wire(wire, axis, wire_bytes("all-reduce", choices, size))
                elif not use.from_input and use.node not in merged:
                    summed = self._summed(use.inputs, use.dtype)
                    add_wire(wire, axis, wire_bytes("all-reduce", summed, size))

    def tpu_router_shards(self) -> dict[str, int]:
        """On XLA:TPU, each split expert bank's replicated router kernels and the bank's axis size.

        XLA:TPU splits a router's logits, its `top_k` and its gradient over the experts' axis as the
        bank is split: the router kernel's gradient is summed over the batch axis in those shards,
        and the routing's operand is not gathered over the batch axis (measured on v5e 2x4, the small
        keras-hub Mixtral on `data=2,model=4`, `data=4,model=2` and `data=2,expert=2,model=2`). A plan
        that keeps such a bank replicated under a budget is not costed apart (its router then gathered
        and summed whole): banks are the model's largest weights, split in every plan measured.
        """
        if self.compiler != "tpu":
            return {}
        axis = self.proposal.expert_axis or self.model_axis
        size = self.axis_sizes[axis]
        banks: dict[str, list[keras.Variable]] = {}
        for variable in self.model.weights:
            unit = self.proposal.units.get(variable.path)
            if unit in self.proposal.expert_units:
                banks.setdefault(unit, []).append(variable)
        return {router.path: size for variables in banks.values() for router in self._routers(variables)}

    def _routers(self, variables: list[keras.Variable]) -> list[keras.Variable]:
        """The replicated kernels whose projections give the logits the bank's routing `top_k` reads.

        Found once per bank (each of its candidates is costed with them).
        """
        key = tuple(v.path for v in variables)
        if key not in self.routers_of:
            self.routers_of[key] = self._find_routers(variables)
        return self.routers_of[key]

    def _find_routers(self, variables: list[keras.Variable]) -> list[keras.Variable]:
        by_node = {use.node: path for path, uses in self.uses.items() for use in uses if use.kind == "matmul"}
        weights = {v.path: v for v in self.model.trainable_weights}
        found: dict[str, keras.Variable] = {}
        for variable in variables:
            for use in self.uses.get(variable.path, ()):
                if use.kind != "matmul" or 0 not in use.batch:
                    continue
                for top_k in self._routing_top_ks(self.trace.nodes[use.node].outputs[0]):
                    logits = self._upstream(top_k.inputs[0], "dot_general")
                    path = by_node.get(logits.index) if logits is not None else None
                    if path in weights and path not in self.proposal.units:
                        found[path] = weights[path]
        return list(found.values())

    def _routing_top_ks(self, value: int) -> list:
        """The `top_k` nodes whose weights scale the experts' outputs `value`."""
        found = []
        for index in self.trace.consumers.get(value, ()):
            node = self.trace.nodes[index]
            if node.primitive != "mul":
                continue
            for operand in node.inputs:
                top_k = self._upstream(operand, "top_k") if operand != value else None
                if top_k is not None:
                    found.append(top_k)
        return found

    def _routing_choices(self, value: int) -> list[float]:
        """Per-device bytes of the `top_k` weights that scale the experts' outputs `value`, if found."""
        top_ks = self._routing_top_ks(value)
        return [math.prod(self.trace.shapes[top_ks[0].outputs[0]]) / self.d * 4] if top_ks else []

    def _upstream(self, value: int, primitive: str, limit: int = 32):
        """The nearest node of `primitive` that `value` is computed from, within `limit` nodes."""
        stack, seen = [value], set()
        while stack and len(seen) < limit:
            current = stack.pop(0)
            if current < 0 or current in seen or current not in self.trace.producer:
                continue
            seen.add(current)
            node = self.trace.nodes[self.trace.producer[current]]
            if node.primitive == primitive:
                return node
            stack.extend(node.inputs)
        return None
