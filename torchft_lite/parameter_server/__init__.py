"""A fault-tolerant parameter server on reconfigurable process groups (torchft's ``torchft.parameter_server``).

::

    class Adder(ParameterServer):
        @classmethod
        def new_process_group(cls):
            return ProcessGroupGloo(timeout=timedelta(seconds=10))

        def forward(self, session_id, pg):
            data = torch.zeros(1)
            pg.broadcast_one(data, root=1).wait()   # from the client
            data += 1
            pg.broadcast_one(data, root=0).wait()   # back to it

    server = Adder(port=0)
    pg = Adder.new_session(server.address())       # in the client: rank 1 of a two-rank group

See :class:`ParameterServer`.
"""

from __future__ import annotations

from .server import ParameterServer

__all__ = ["ParameterServer"]
