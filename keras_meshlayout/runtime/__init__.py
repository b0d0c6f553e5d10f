"""Running on several processes: cluster detection, `initialize`, the local launcher.

- `_cluster`: `ClusterConfig` and `cluster_config`, read from arguments and the environment.
- `_initialize`: `initialize`, its watchdog, step pacing and exit on failure.
- `_launch`: the `keras-meshlayout launch` local launcher; `_worker`: what each process runs.
"""
