"""The core: meshes, rules, how a variable's layout is resolved, the distribution and its plan.

Nothing here imports the planner, the reports, the runtime, checkpoints or the command line,
and no module here imports one that imports it back (`tests/test_import_graph.py`).

- `_errors`: every error and warning; `_backend`: JAX backend checks and emulated CPU devices;
  `_format`: bytes, axes, id ranges, mesh names, tables as text; `_progress`: a spinner and a
  bytes bar, drawn on a terminal only.
- `_axes`: layouts as data (entries, their axes, shards, JSON).
- `_matcher`: the pure matching engine, first match wins; `_rule`: `Rule` and its named checks;
  `_rules`: `LayoutRules`, the container; `_layout_map`: a Keras `LayoutMap` as our rules.
- `_policy`: `LayoutPolicy`; `_shape_checks`: rank, axis names and divisibility are decided here;
  `_resolve`: one variable's layout (`resolve`, `Resolution`).
- `_targets`: TPU machines as data (`Target`, published per-chip figures) and their
  `tpu-v5e:16x16` form; `_target_mesh`: meshes on a target's compile-only devices, or on none
  (`jax.sharding.AbstractMesh`).
- `_mesh_spec`: mesh specs parsed and sizes inferred; `_mesh`: `Mesh`; `_placement`: meshes
  across processes; `_process_data`: which rows of a global batch each process feeds.
- `_memory`: per-device bytes and optimizer slots; `_plot`: the plan's figure; `_summary`: big
  plans with repeated blocks folded; `_plan`: the value `Plan`; `_planning`: `plan_model`, a
  `Plan` from a model under a distribution.
- `_held`: what the variables really hold (their arrays' shardings), read by the plan and hooks.
- `_trainer_hooks`: the hooks in Keras's trainer (the one batch decision, errors);
  `_distribution`: `ModelParallel`; `_dry`: building a model without allocating its weights.
"""
