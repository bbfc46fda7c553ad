"""The MoE experts benchmark: ``python -m bench --help``; ``python -m bench.crossover FILE...`` for the decode switch."""
