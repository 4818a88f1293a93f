"""Stragglers: :mod:`.scores` how slow each group computes, :mod:`.rules` the quorum rules that flag and may
evict one, :mod:`.view` how /api/status and /metrics show them."""
