"""The model: one module per family (:mod:`.families`: its config and GGUF reading, weight
names, refusals and forward), the layers the forwards are composed of (:mod:`.layers`), the
linear layers and their weight formats (:mod:`.linear`, :mod:`.q4`, :mod:`.kquant`), the
element-wise ops in PyTorch (:mod:`.ops`), and the weights' loading (:mod:`.weights`)."""
