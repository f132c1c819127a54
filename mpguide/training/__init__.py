"""The backward pass and the training loop, one module per job: autograd graphs with their
dtypes (``autograd``), casting a module and master weights (``casting``,
``master_weights``), loss scaling (``loss_scaling``), optimizer precision (``optimizers``),
training recipes (``loop``; ``lowbit`` for low-bit GEMMs), layers with state
(``norm_layers``), gradients summed in one dtype (``grad_sums``), and gloo process groups,
FSDP2 sharding and communication dtypes (``distributed``).
"""
