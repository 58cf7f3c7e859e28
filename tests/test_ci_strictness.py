"""Skips that cannot hide a setup fault in CI (issue 36): under POSPROBE_CI=1 (.ci/run) a missing ../shared path
fails instead of skipping, and a TransformerLens adapter gap fails unless it is declared in EXPECTED_ADAPTER_GAPS."""

from __future__ import annotations

import pytest
from conftest import require_shared, skip_or_fail_in_ci
from families import EXPECTED_ADAPTER_GAPS, missing_adapter


def test_require_shared_fails_on_a_missing_path_under_posprobe_ci(tmp_path, monkeypatch):
    monkeypatch.setenv("POSPROBE_CI", "1")
    with pytest.raises(pytest.fail.Exception, match="POSPROBE_CI=1 but .*absent.*not present"):
        require_shared(tmp_path / "absent", "a test's data")
    assert require_shared(tmp_path, "a test's data") == tmp_path  # present: returned as is


def test_require_shared_skips_on_a_missing_path_in_a_users_clone(tmp_path, monkeypatch):
    monkeypatch.delenv("POSPROBE_CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="absent.*not present \\(a test's data"):
        require_shared(tmp_path / "absent", "a test's data")
    monkeypatch.setenv("POSPROBE_CI", "0")
    with pytest.raises(pytest.skip.Exception):
        skip_or_fail_in_ci("anything")


def test_an_undeclared_missing_adapter_fails_and_a_declared_one_skips():
    with pytest.raises(pytest.fail.Exception, match=r"TL 4\.3\.0 has no adapter for FakeForCausalLM \(family fake\): "
                                                    r"add it to the expected gaps .* or pin TL"):
        missing_adapter("fake", "FakeForCausalLM", "4.3.0")
    assert "RobertaForMaskedLM" in EXPECTED_ADAPTER_GAPS["3"]
    with pytest.raises(pytest.skip.Exception, match=r"TransformerLens 3\.9\.0 has no adapter for RobertaForMaskedLM"):
        missing_adapter("roberta", "RobertaForMaskedLM", "3.9.0")
    # declared for TL 3 only: the same gap under TL 4, or under a major version with no entry, fails
    for tl in ("4.3.0", "5.0.0"):
        with pytest.raises(pytest.fail.Exception, match=f"TL {tl} has no adapter for RobertaForMaskedLM"):
            missing_adapter("roberta", "RobertaForMaskedLM", tl)
