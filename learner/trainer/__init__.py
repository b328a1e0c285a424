"""The built-in trainer: `atoll learner`, a byte-level transformer (model.py) trained on
text (data.py) by a jitted step (train.py, over the mesh of mesh.py), one island's run
(loop.py) from its flags (main.py). It is one user of the library in atoll.learner: it
imports the library, the library never imports it.
"""
