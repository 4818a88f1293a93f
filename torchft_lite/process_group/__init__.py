"""Process groups across replica groups, rebuilt whenever the quorum changes.

``ProcessGroupGloo`` (CPU) and ``ProcessGroupNCCL`` (CUDA) wrap a fresh c10d
backend per ``configure()``; ``ProcessGroupBabyGloo`` and ``ProcessGroupBabyNCCL``
run that backend in a child process, so an abort is a kill;
``ProcessGroupDummy`` exchanges nothing. All of them subclass
:class:`torch.distributed.ProcessGroup`.
"""

from .baby import ProcessGroupBaby, ProcessGroupBabyGloo, ProcessGroupBabyNCCL
from .base import ProcessGroup, ReconfigurableProcessGroup
from .dummy import ProcessGroupDummy
from .gloo import ProcessGroupGloo
from .nccl import ProcessGroupNCCL
from .store import StoreAddress, parse_store_addr
from .work import CompletedWork, TrackedWork

__all__ = [
    "CompletedWork",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ReconfigurableProcessGroup",
    "StoreAddress",
    "TrackedWork",
    "parse_store_addr",
]
