"""Running on several processes: cluster detection, `initialize`, the local launcher.

- `_cluster`: `ClusterConfig` and `cluster_config`, read from arguments and the environment.
- `_initialize`: `initialize`, its watchdog, step pacing and exit on failure.
- `_launch`: the `keras-meshlayout launch` local launcher's command line and `launch`, built on
  `_ports` (one job per coordinator port: the lock, and who holds it), `_supervise` (waiting for
  the processes, the first failure, stopping them), `_relay` (each line prefixed with its rank)
  and `_failure` (what the launcher says at the end, and its exit status).
- `_worker`: what each launched process runs.

Each process's share of the data (`process_slice`, `local_batch_size`) is in
`core._process_data`, since the distribution lays out its batches by it; the
multi-process `save_weights` is in `checkpoint._weights`.
"""
