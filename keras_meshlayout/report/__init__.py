"""Reports: the compiled HLO's traffic, the communication report, terminal views and plots.

- `_hlo`: collectives read from compiled HLO text, bytes on the wire.
- `_comm`: `comm_report`, one compiled training step's communication.
- `_pictures`: terminal pictures of a mesh and of one variable's shards.
- `_plots`: `plot_plan`, matplotlib figures of a plan.
"""
