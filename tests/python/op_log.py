"""A torch dispatch mode that records the ops it sees and runs them unchanged: how the torch tests
see that a call went through the dispatcher (as tracing and dispatch modes meet it), and with
which arguments."""

import torch


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Each op seen as (OpOverload, args) in `calls`, in order; `names` lists their packets' names
    ("sparsetrain.block_sparse_attention", ...)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def names(self):
        return [str(func.overloadpacket) for func, _ in self.calls]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))
