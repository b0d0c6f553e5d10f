"""Checkpoints: save, load and resume sharded models, with the plan and a manifest.

- `_checkpoint`: `save_checkpoint`, `load_checkpoint`, `ResumableCheckpoint`, `plan_diff`.
- `_orbax_store`: the arrays stored with Orbax, each process writing and reading its own shards.
"""
