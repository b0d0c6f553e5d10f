"""Running on several processes: cluster detection, `initialize`, the local launcher.

- `_cluster`: `ClusterConfig` and `cluster_config`, read from arguments and the environment.
- `_initialize`: `initialize`, its watchdog, step pacing and exit on failure.
- `_launch`: the `keras-meshlayout launch` local launcher; `_worker`: what each process runs.

Each process's share of the data (`process_slice`, `local_batch_size`) is in
`core._process_data`, since the distribution lays out its batches by it; the
multi-process `save_weights` is in `checkpoint._weights`.
"""
