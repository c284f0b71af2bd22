"""The trainer: one ``Trainer`` Protocol (``protocol.py``), implemented by the one-process trainer
(``local.py``) and the sharded group of torch.distributed ranks (``distributed/``); the batch, the
algorithm parts of a step (``algorithms.py``, ``critic.py``, ``reference.py``) and checkpoints."""
