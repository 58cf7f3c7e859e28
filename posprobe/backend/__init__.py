"""The only package that imports TransformerLens or touches model internals.

Everything else asks it through the functions exported by its modules: `loading` (specs to models),
`sources` (where a spec points, torch-free), `facts` (what kind of model it is), `hooks` (hook
names, attaching hooks, the attention internals position control needs).
"""
