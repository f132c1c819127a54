"""The backward pass and the training loop: autograd graphs with their dtypes
(``autograd``), casting a module and master weights (``casting``, ``master_weights``), and
loss scaling, optimizer precision, layers with state, recompute and communication dtypes
(``loop``).
"""
