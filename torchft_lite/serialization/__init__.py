"""The heal format: a state dict as a declared header and raw tensor bytes, no pickle.

Live heals (:mod:`torchft_lite.checkpointing`) and durable checkpoints (:mod:`torchft_lite.durable`) both
write and read it: :mod:`.spec` what a header declares and the checks on it, :mod:`.encode` and
:mod:`.decode` the two sides, :mod:`.checksum`, :mod:`.dtensor` (sharded tensors), and how received bytes
reach their destination (:mod:`.prefault`, :mod:`.staging`, :mod:`.cuda`).
"""
