"""The bytes a tiny model saves for backward, measured (`_saved_bytes`): the activation formula's oracle in
tests/unit/test_estimate_memory.py and test_wan22_ti2v.py."""

import torch


def _saved_bytes(model, inputs, checkpointing):
    """Bytes of the tensors autograd keeps for backward (storage-deduplicated, parameters excluded):
    what a GPU holds at the end of the forward."""
    if checkpointing:
        model.enable_gradient_checkpointing()
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(v for k, v in storages.items() if k not in params)
