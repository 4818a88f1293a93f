"""The replica group's server (one per group, in group rank 0's process) and how ranks and the lighthouse reach it.

The ManagerServer gathers its ranks' quorum and commit calls, speaks for the group at the lighthouse
(heartbeats, the lease and its fence) and computes each rank's part of an issued quorum.
"""
