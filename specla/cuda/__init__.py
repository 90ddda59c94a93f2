"""CUDA graphs: the plumbing that records work into a graph and keeps its static buffers
(:mod:`specla.cuda.capture`), and the speculative step recorded per batch size
(:mod:`specla.cuda.graph_step`)."""
