"""The key-squish variants' names, torch-free: the CLI's checks (before a model loads), the preset registry and
`surgery.key_squish` read them from here (one place; importing them from the registry made a cycle with surgery)."""

#: Key-squish variants (`surgery.key_squish`), each named for what the squished span's own tokens do: "cache" (the
#: span reads itself at its own positions, later tokens see its keys squished), "keys" (every query, the span's own
#: included, sees its keys squished; its queries keep their positions), "qk" (its queries and keys both squished:
#: Hugging Face position_ids). Kept here, torch-free, so the CLI's checks before a model loads can name them.
SQUISH_VARIANTS = ("cache", "keys", "qk")
#: Why the old variant name "global" is refused rather than kept: it read as "the span reads itself at position 0"
#: (queries too), which it never did; refused, every old command has to say which of the two it meant.
RENAMED_VARIANT = ("'global' was renamed: it moved only the span's keys (its queries kept their positions); say "
                   "'keys' for that, or 'qk' for the span's queries and keys both at the squished positions")
