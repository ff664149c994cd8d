"""What Lightning lacks for our modes: building the strategy from config, and a Hydra-aware process launch."""
