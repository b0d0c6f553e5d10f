"""Checkpoints: save, load and resume sharded models, with the plan and a manifest.

Modules, lowest first (each imports only those above it):

- `_orbax_store`: the arrays stored with Orbax, each process writing and reading its own shards.
- `_plan_diff`: `plan_diff`, `PlanDiff`, `LayoutChange`: what changes between two plans.
- `_manifest`: the format, the manifest and its schema, the checks of the model and files against it.
- `_rng`: the random state (seed generators) saved in the manifest and restored on load.
- `_atomic`: hidden sibling directories, fsync and rename, recovery of interrupted saves.
- `_save`: `save_checkpoint` (Orbax by default, or h5), in every process, and the background save.
- `_load`: `load_checkpoint`: everything checked before anything is assigned, rollback on failure.
- `_resume`: `ResumableCheckpoint`, the callback that backs training up and resumes it exactly.
- `_weights`: `save_weights` in a multi-process run (every process calls it, process 0 writes).
"""
