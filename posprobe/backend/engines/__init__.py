"""Engines other than Hugging Face that run a model posprobe can prove against HF: what each declares about its
rotary positions (per layer type), and how it scores token ids. One module per engine (`llama_cpp.py`); the HF
reference of the same model's positions (`reference.py`); the declared rotation of an engine as one record
(`rope.py`: `EngineRope`, its per-band frequencies by the engine's own formulas). The comparison lives in
`posprobe.analyses.conform`. Torch-free at import."""
