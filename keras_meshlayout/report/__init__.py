"""Reports: the compiled HLO's traffic, the communication report, terminal views.

- `_collectives`: what a collective sends (the ring formulas), for the report and the planner.
- `_loops`: how often each counted loop's body runs in compiled HLO text (XLA:TPU's windowed einsums).
- `_hlo`: collectives read from compiled HLO text.
- `_megascale`: what crosses slices in a multi-slice program (the megascale runtime's host
  transfers), read as collectives on the data-center network.
- `_comm`: `comm_report`, one compiled training step's communication.
- `_compile`: `compile_step`, the training step compiled for a mesh (a TPU target) from a dry
  build, with XLA's bytes per device.
- `_pictures`: terminal pictures of a mesh and of one variable's shards.

The plan's figure (`plot_plan`, matplotlib) lives in `core/_plot.py`, beside the `Plan`
it draws, so that `Plan.plot` imports nothing from this higher layer.
"""
