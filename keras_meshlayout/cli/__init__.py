"""The `keras-meshlayout` command line: one module per subcommand.

- `_main`: `main` and the parser, assembled from the subcommand modules.
- `_args`: what they share: exit statuses, the one-line input error, argument types.
- `_devices`: `keras-meshlayout devices`.
- `_plan`: `keras-meshlayout plan` (its arguments, the run, the output and progress);
  `_plan_inputs`: what it reads (model builders, rules files, presets, optimizers, batches);
  `_plan_compile`: what `--target` and `--compile` add (the target, the compile check);
  `_plan_mesh`: `--mesh auto` (the mesh chosen, `kml.choose_mesh`);
  `_preset_table`: the presets as `plan --help` lists them, without importing the planner.
- `_demo`: `keras-meshlayout demo`.
- `_launch`: `keras-meshlayout launch`, handed to the launcher in `runtime._launch`.
"""
