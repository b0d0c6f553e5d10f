"""The core: meshes, rules, how a variable's layout is resolved, the distribution and its plan.

Nothing here imports the planner, the reports, the runtime, checkpoints or the command line.

- `_mesh`: `Mesh`, device order, mesh helpers.
- `_rules`: `Rule`, `LayoutRules`, the rule index (first match wins).
- `_resolve`: one variable's layout from the first matching rule (`resolve`, `Resolution`).
- `_shape_checks`: where a layout meets a shape: rank, axis names and divisibility are decided here.
- `_policy`: `LayoutPolicy`, what to do with a dimension that does not divide and small matrices.
- `_layout_map`: a Keras or keras-hub `LayoutMap` converted into our rules.
- `_distribution`: `ModelParallel`, what Keras calls for each variable and batch.
- `_process_data`: which rows of a global batch each process feeds.
- `_inference`: predict/evaluate batches that do not split.
- `_plan`: the `Plan` of a model, `_plot`: its matplotlib figure, and `_memory`: per-device
  bytes and optimizer slots.
- `_dry`: building a model without allocating its weights.
- `_errors`: every error and warning the package raises; `_format`: bytes, axes, tables.
- `_backend`: JAX backend checks and emulated CPU devices.
"""
