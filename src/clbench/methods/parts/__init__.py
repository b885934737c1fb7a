"""Parts several methods share, one small module each (as timm keeps ``layers/`` under ``models/``): a method file
reads as its paper's algorithm over them.

- :mod:`~clbench.methods.parts.bottleneck`: down-projection, activation, dropout, up-projection (every adapter's core);
- :mod:`~clbench.methods.parts.adaptformer`: AdaptFormer's parallel MLP adapter;
- :mod:`~clbench.methods.parts.ssf`: SSF's per-channel scale and shift after a layer;
- :mod:`~clbench.methods.parts.vpt`: VPT's prompt tokens, deep (one set per block) or shallow (at the input);
- :mod:`~clbench.methods.parts.petl`: one of those attached to a timm ViT by name, switched on and off as a whole;
- :mod:`~clbench.methods.parts.adapter_sets`: AdaptFormer adapter sets side by side, one per task, any one selected;
- :mod:`~clbench.methods.parts.cosine`: cosine logits, and the sigma-scaled cosine head PILOT-family codes train;
- :mod:`~clbench.methods.parts.ridge`: random ReLU features and a ridge (analytic) head from fp64 statistics;
- :mod:`~clbench.methods.parts.gaussian_alignment`: per-class feature Gaussians and the head-only stage that trains on
  their draws (classifier alignment).
"""
