"""What training backends that drive ranks have in common (FSDP, Megatron, ...).

``driver``: the ``TrainingBackend`` side, running ranks in this process or as Ray actors;
``rank_setup``: helpers each rank uses to set itself up; ``ray_actors``: calling and stopping rank
actors. Plugins import these; nothing here imports a plugin, and importing this package imports
nothing heavy.
"""
