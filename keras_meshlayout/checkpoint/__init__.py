"""Checkpoints: save, load and resume sharded models, with the plan and a manifest.

Modules, lowest first (each imports only those above it):

- `_orbax_store`: the arrays stored with Orbax, each process writing and reading its own shards.
- `_plan_diff`: `plan_diff`, `PlanDiff`, `LayoutChange`: what changes between two plans.
- `_manifest`: the format, the manifest and its schema, the checks of the model and files against it.
- `_rng`: the random state (seed generators) saved in the manifest and restored on load.
- `_atomic`: the one save procedure (`writing`): hidden sibling directories, fsync and rename, the
  error of a failed save; recovery of interrupted saves.
- `_finite`: the finite-state guard (the first variable holding NaN or infinity).
- `_backups`: the backups a `ResumableCheckpoint` keeps (`latest`, `step-N`), and which to resume from.
- `_lock`: one directory, one run: the lock a training run holds on its backup directory.
- `_preemption`: SIGTERM and SIGINT caught while training, and the step every process stops at.
- `_save`: `save_checkpoint` (Orbax by default, or h5), in every process, and the background save.
- `_load`: `load_checkpoint`: everything checked before anything is assigned, rollback on failure.
- `_resume`: `ResumableCheckpoint`, the callback that backs training up and resumes it exactly.
- `_weights`: `save_weights` in a multi-process run (every process calls it, process 0 writes).
"""
