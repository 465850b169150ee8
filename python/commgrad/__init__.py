"""commgrad's transport as a torch.distributed backend.

``import commgrad`` registers the backend ``"commgrad"`` for CPU tensors::

    import commgrad, torch.distributed as dist
    dist.init_process_group("commgrad")        # or backend="cpu:commgrad,cuda:nccl"

Each process group (the default one and every ``new_group``) decides its own
transport when it is created: commgrad's shared-memory transport ``shm`` when
every rank of the group runs on this host, otherwise commgrad's hierarchical
transport or Gloo, so choosing it is never worse than Gloo.
"""

import torch  # loads the LibTorch the extension was built against
import torch.distributed as dist

from . import _C

__all__ = ["BACKEND", "transport", "describe", "build_info"]

#: The name to pass to ``torch.distributed.init_process_group``.
BACKEND = "commgrad"


def _create_backend(opts, backend_options=None):
    # c10d's creator function (extended API): the store is already prefixed
    # for this group and device.
    return _C._create_backend(
        opts.store, opts.group_rank, opts.group_size, opts.timeout.total_seconds(), str(opts.group_id)
    )


def _backend_of(group=None):
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg._get_backend(torch.device("cpu"))


def transport(group=None) -> str:
    """The transport that carries ``group``'s CPU tensors: ``"shm"``, ``"gloo"`` or ``"hierarchical"``."""
    return _C._transport(_backend_of(group))


def describe(group=None) -> str:
    """``"rank 0/4 group '0' (shm)"``: the group as commgrad's error messages name it."""
    return _C._describe(_backend_of(group))


def build_info() -> str:
    """What this build is, e.g. ``"commgrad 0.2.0 (LibTorch 2.15.0, C++20; transports: gloo shm nccl)"``."""
    return _C.build_info()


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create_backend, extended_api=True, devices=["cpu"])
