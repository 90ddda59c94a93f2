"""specla plugin for transformers' Mamba2 family: Mamba2, Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1."""
