"""The model: one forward-pass module per architecture family (:mod:`.llama`; the family of a
``model_type`` in :mod:`.families`), and what the families share: RoPE (:mod:`.rope`), the
linear layers and their weight formats (:mod:`.linear`, :mod:`.q4`), the element-wise ops in
PyTorch (:mod:`.ops`), and the weights' loading (:mod:`.weights`)."""
