"""The `keras-meshlayout` command line: one module per subcommand.

- `_main`: `main` and the parser, assembled from the subcommand modules.
- `_args`: what they share: exit statuses, the one-line input error, argument types.
- `_devices`: `keras-meshlayout devices`.
- `_plan`: `keras-meshlayout plan` (models, rules files, presets, `--auto`, budgets).
- `_demo`: `keras-meshlayout demo`.
- `_launch`: `keras-meshlayout launch`, handed to the launcher in `runtime._launch`.
"""
