"""A model as specla runs it: the plugin's description (:mod:`specla.model.spec`: ``Placement``,
``ModelSpec``) and the one adapter built from it (:mod:`specla.model.adapter`: ``ModelAdapter``),
with the sizes of its prefill passes (:mod:`specla.model.prefill`)."""
