"""The parallel shape of a run and how it is applied, one concern per module:

    layout.py    the ONE validated object for the run's parallel shape (Layout: sizes, mesh shape and names, FSDP,
                 each layer's activation checkpointing, build_mesh) and `parallel.layout: auto`'s choice of it
    mesh.py      the launcher's environment and the process group (init_distributed), nothing else
    apply.py     ep → activation checkpointing → compile → FSDP2, each a plain function reading the layout
    grads.py     what a step does to the gradients across ranks (accumulation, all-reduce, clipping)
    estimate.py  peak memory of a layout: weights, optimizer, FSDP's gathered units, activations, working sets
    activations.py  what each layer saves for backward per token, each term named after the module that saves it
    ac_modes.py  the activation-checkpointing setting and its one reader (no torch: the config reads it)
"""
