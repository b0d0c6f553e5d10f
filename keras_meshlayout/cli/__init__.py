"""The `keras-meshlayout` command line: one module per subcommand.

- `_main`: the parser and `main`.
- `_demo`: `keras-meshlayout demo`.
"""
