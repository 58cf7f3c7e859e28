"""Targeted capture and streaming reducers, against full caches and one-shot torch statistics."""

from __future__ import annotations

import pytest
import torch

from posprobe.backend.hooks import hooked
from posprobe.core.capture import RunningMean, batches, capture, mean_by_position, stream


def test_capture_matches_run_with_cache_and_runs_only_requested_hooks(tiny_rope):
    toks = tiny_rope.to_tokens(["Hello there friend", "Another line here"])
    fired = []
    watch = [(n, lambda x, hook: fired.append(hook.name)) for n in tiny_rope.hook_dict if n.startswith("blocks.1.")]
    with hooked(tiny_rope, watch):
        got = capture(tiny_rope, toks, ["rot_q", "scores"], layers=[0], heads=[1, 3])
    # Layer 1 never ran: capture stops after the last requested layer. A bridge stops at block 1's input
    # hook (its stop_at_layer raises there), so only that entry point may fire.
    assert [n for n in fired if n not in ("blocks.1.hook_in", "blocks.1.hook_resid_pre")] == []
    _, cache = tiny_rope.run_with_cache(toks)
    assert torch.equal(got[("rot_q", 0)], cache["blocks.0.attn.hook_rot_q"][:, :, [1, 3]])
    assert torch.equal(got[("scores", 0)], cache["blocks.0.attn.hook_attn_scores"][:, [1, 3]])


def test_capture_rejects_bad_requests(tiny_rope):
    toks = tiny_rope.to_tokens("Hi")
    with pytest.raises(ValueError, match="out of range"):
        capture(tiny_rope, toks, ["q"], layers=[5])
    with pytest.raises(ValueError, match="Unknown capture point"):
        capture(tiny_rope, toks, ["nope"], layers=[0])


def test_running_mean_equals_one_shot_statistics():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, 3, 4, generator=g) * 5 + 2 for n in (1, 7, 30, 2)]
    rm = RunningMean()
    for c in chunks:
        rm.update(c)
    allx = torch.cat(chunks).double()
    torch.testing.assert_close(rm.mean, allx.mean(0), atol=1e-12, rtol=0)
    torch.testing.assert_close(rm.var, allx.var(0, unbiased=False), atol=1e-10, rtol=0)
    assert float(rm.count.max()) == 40


def test_stream_mean_by_position_equals_full_batch_mean(tiny_ape):
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 256, (10, 12), generator=g)
    (state,) = stream(tiny_ape, batches(rows, 3), [mean_by_position("resid_pre", [1])], total=4, progress=False)
    _, cache = tiny_ape.run_with_cache(rows)
    torch.testing.assert_close(state[1].mean, cache["blocks.1.hook_resid_pre"].double().mean(0), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="Empty input"):
        stream(tiny_ape, iter([]), [mean_by_position("resid_pre", [0])], progress=False)
