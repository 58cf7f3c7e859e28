"""The only package that imports TransformerLens or touches model internals (layer 1).

Everything above asks it through a few modules: `loading` (specs to models), `hf` (the one door to plain
Hugging Face models), `facts` (one ModelFacts shape), `model` and `hooks` (the façades: forward, unembedding,
hook names, attaching hooks, the attention internals position control needs), `sources` and `peek` (where a
spec points and what its config says, torch-free). Backend-specific work sits in two adapters with the same
functions, `bridge_ops` (TransformerBridge) and `legacy_ops` (TL 3), chosen in one place: `dispatch.ops`.
"""
