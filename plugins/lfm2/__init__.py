"""specla plugin for transformers' LFM2: gated short convolutions and attention."""
