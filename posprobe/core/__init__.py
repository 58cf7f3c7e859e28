"""Model-independent machinery: RoPE maths, position plans and surgery presets, capture and
streaming reducers, scoring at chosen positions, generation. Talks to models only via `backend`."""
