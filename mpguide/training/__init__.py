"""The backward pass and the training loop, one module per job: autograd graphs with their
dtypes (``autograd``), casting a module and master weights (``casting``,
``master_weights``), loss scaling (``loss_scaling``), optimizer precision (``optimizers``),
training recipes (``loop``; ``lowbit`` for low-bit GEMMs), layers with state
(``norm_layers``), gradients summed in one dtype (``grad_sums``), gloo process groups, FSDP2
sharding and communication dtypes (``distributed``), the dtype each op family ran in
(``op_dtypes``), peak bytes counted at the dispatcher (``peak_bytes``), the loss head's ways
(``loss_head``), LoRA adapters on a bf16 base (``lora_precision``) and the train/serve
logprob gap of reinforcement learning (``logprob_gap``).
"""
