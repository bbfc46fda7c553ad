"""One module per backend."""
