"""Everything one training rank does, plus what the supervisor shares with the ranks (config, cache, progress)."""
