"""Model-independent machinery (layer 2): position plans and surgery, the preset registry, the chunked
long-context engine, capture and streaming reducers, scoring at chosen positions, generation. Talks to models
only through `backend`; RoPE maths is one floor down, in `posprobe.rope`."""
