"""Grammar of surgery preset specs (kept torch-free for the CLI)."""

PRESET_HELP = ("none | shift:k=K | pi:scale=S | ntk:scale=S | yarn:scale=S,original=L[,beta_fast=32,beta_slow=1] | "
               "self-extend:group=G,window=W | rerope:window=W | streaming:sink=S,window=W | "
               "p-rope:p=P | drop:lowest=A,highest=B")
